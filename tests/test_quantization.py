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


TEXT = ("The river rose slowly through the night, and by morning the low fields on the east bank were under "
        "water. The farmers had moved their animals to the hill the day before, so nothing was lost but a "
        "week of work. In the village the talk was of the new bridge, which had stood against the flood "
        "while the old ford disappeared. Children walked along the bank to see how high the water had come, "
        "and the miller wrote the level on his wall beside the marks of earlier years. When the water went down, "
        "the bridge was the first thing the engineers from the town came to look at. They measured the stones of "
        "its piers, tapped the mortar with small hammers and wrote numbers in a book, and at the end of the second "
        "day they said it would stand for another hundred years. The miller did not believe them. He had seen the "
        "river take the mill race twice, and he knew that a flood did its damage slowly, under the surface, where "
        "no hammer could reach. That winter he built a wall of sandbags along the lane behind the mill, and the "
        "younger men laughed at him until the spring rains came. In March the river rose again, higher than anyone "
        "remembered, and the water stopped a hand's width below the top of his wall. After that, people listened "
        "when he talked about the river, and the council asked him to write down everything he knew about the "
        "floods of the past fifty years, which he did in a small green notebook that is kept today in the village "
        "library.")  # 308 tokens: over 100, a logit's bfloat16 rounding alone moved the perplexity by 0.4%


def _perplexity(runner, ids: list[int]) -> float:
    from tests.model_helpers import prefill_logits

    logits = prefill_logits(runner, ids).float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(nll.exp())


@pytest.mark.parametrize(("method", "dtype"), [("gguf", torch.float32), ("gguf", torch.bfloat16),
                                               ("int4", torch.float32)])
def test_a_ggufs_own_blocks_are_kept_and_its_perplexity(loaded_model, default_model_path, hf_tokenizer, method, dtype):
    """The default GGUF is Q4_1 with a Q8_0 head (tied to the embedding). `gguf` (what
    --quantization auto picks) and int4 take the file's values, scales and minimums as they are:
    the dense path's weights equal the file's; the kernel stores scale and zero point in bfloat16,
    its only rounding; the Q8_0 head keeps its 8 bits as two 4-bit halves. The perplexity of a
    fixed text stays within 0.5% of float32's, in a float32 model (AVX2's default) and a bfloat16
    one (AVX-512 BF16's), through the dense path and through the kernels."""
    from services.worker.backends.torch_cpu.quantization import native_int4_blocks
    from services.worker.loader import load_model
    from services.worker.loader.gguf_blocks import for_module
    from tests.model_helpers import make_runner

    quant = load_model(default_model_path, dtype=dtype)
    float_weights = {n: m.weight.detach().clone() for n, m in quant.model.named_modules() if isinstance(m, nn.Linear)}
    blocks = native_int4_blocks(quant, method)
    quantize(quant.model, method, blocks)
    layers = dict(quant.model.named_modules())
    assert not any(isinstance(m, nn.Linear) for m in quant.model.modules())  # every weight of this file is kept
    for name in ("layers.0.attention.wqkv", "layers.0.feed_forward.w13", "layers.29.feed_forward.w2", "output"):
        q, b = layers[name], for_module(blocks, name)
        assert isinstance(q, Int4Linear) and q.folds == (2 if name == "output" else 1)
        assert torch.equal(q.dequantized, float_weights[name])  # the file's weights, in the model's dtype
        scale, zero = q.scales_and_zeros.transpose(0, 1).float().unbind(-1)  # [n, folds * k / 32] each
        assert torch.equal(scale, b.scale.to(torch.bfloat16).float())
        assert torch.equal(zero, (b.low + 8 * b.scale).to(torch.bfloat16).float())
        n, k = q.dequantized.shape
        groups = (b.q.view(n, -1, INT4_GROUP).float() - 8) * scale[..., None] + zero[..., None]
        stored = groups.view(n, q.folds, k).sum(1)  # the file's weights with bfloat16 scales
        through_kernel = q.kernel(torch.eye(k, dtype=torch.bfloat16)).float().t()  # W, row by row
        torch.testing.assert_close(through_kernel, stored, rtol=2**-8, atol=1e-6)
    ids = hf_tokenizer.encode(TEXT)
    reference = _perplexity(make_runner(loaded_model), ids)
    runner = make_runner(quant, num_blocks=64, max_model_len=1024, kv_dtype=dtype)
    dense = _perplexity(runner, ids)  # a prefill's rows take the dense path: the file's weights
    for module in quant.model.modules():
        if isinstance(module, (Int4Linear, Int8Linear)):
            module.small_batch = 10**9  # every row through the int4 kernel, as decode steps go
    kernels = _perplexity(runner, ids)
    print(f"\nperplexity: float32 {reference:.4f}, {method} {dtype} dense {dense:.4f}, kernels {kernels:.4f}")
    if dtype == torch.float32:
        assert dense == pytest.approx(reference, rel=1e-5)  # the same weights
    for ppl in (dense, kernels):
        assert abs(ppl / reference - 1) < 0.005, (reference, dense, kernels)
