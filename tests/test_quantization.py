"""Weight-only int8 and int4: the kernel and the dense path compute with the same quantized weights;
and every method, w8a8 too, keeps the model close to the float32 reference (the faster path is
checked against the torch path)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.worker.backends.torch_cpu.quantization import (
    INT4_GROUP,
    SMALL_BATCH,
    Int4Linear,
    Int8Linear,
    quantize,
)


def test_int8_linear_small_and_large_batches_compute_the_same_weights():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    q = Int8Linear(linear)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (48,)
    assert (q.dequantized - linear.weight).abs().max() <= q.scale.max() / 2 + 1e-6  # rounding error only
    small = SMALL_BATCH[torch.float32]
    for rows in (1, small, small + 1, 40):
        x = torch.randn(rows, 64)
        assert q.uses_kernel(x) == (rows <= small)
        expected = x @ q.dequantized.t() + linear.bias
        out = q(x)
        assert out.dtype == torch.float32
        # the kernel takes its rows rounded to bfloat16; the dense path is exact
        tolerance = 0.02 if rows <= small else 1e-4
        torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_kernel_and_dense_path_compute_the_same_weights(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=False).to(dtype)
    q = Int4Linear(linear)
    groups = linear.weight.float().view(64, -1, INT4_GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # one int4 step per group
    assert ((q.dequantized.float() - linear.weight.float()).view(64, -1, INT4_GROUP).abs().amax(-1)
            <= step / 2 + 0.02 * groups.abs().amax(-1)).all()  # rounding (and bf16) error only
    small = SMALL_BATCH[dtype]
    for rows in (1, small, small + 1, 40):
        x = torch.randn(rows, 128).to(dtype)
        assert q.uses_kernel(x) == (rows <= small)
        expected = x.float() @ q.dequantized.float().t()
        out = q(x)
        assert out.dtype == dtype  # a float32 model's rows go to the kernel as bfloat16 and come back
        torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.02)


@pytest.mark.parametrize(("method", "dtype"), [("int8", torch.bfloat16), ("int4", torch.bfloat16),
                                               ("int4", torch.float32), ("w8a8", torch.float32)])
def test_quantized_model_agrees_with_float32(loaded_model, default_model_path, hf_tokenizer, method, dtype):
    from services.worker.loader import load_model
    from tests.model_helpers import make_runner, prefill_logits
    from tests.test_llama_vs_hf import PROMPTS

    quant = load_model(default_model_path, dtype=dtype)
    quantize(quant.model, method)
    assert not any(isinstance(m, nn.Linear) for m in quant.model.modules())
    fast = make_runner(quant, num_blocks=64, kv_dtype=dtype, max_model_len=1024)
    reference = make_runner(loaded_model)
    agree = total = 0
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        ours, theirs = prefill_logits(fast, ids).float(), prefill_logits(reference, ids)
        # the next token itself; where the reference's top two are a near tie (" def" 21.81 against
        # " fib" 21.77 after the fibonacci prompt), either of them
        top2 = theirs[-1].topk(2)
        near_tie = float(top2.values[0] - top2.values[1]) < 0.25
        assert int(ours[-1].argmax()) in (top2.indices.tolist() if near_tie else top2.indices[:1].tolist()), prompt
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(ids)
    # int4 and w8a8 are the lossier: 44/49 of the prompt positions for int4 on one VM, more on
    # another (the bf16 kernels differ by CPU), so their floor is lower
    assert agree / total >= (0.9 if method == "int8" else 0.85), f"{agree}/{total}"
