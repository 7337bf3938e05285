"""Weight-only int8: both kernels compute with the same int8 weights, and the model stays close to
the float32 reference (the faster path is checked against the torch path)."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.quantization import SMALL_BATCH, Int8Linear, quantize_int8


def test_int8_linear_small_and_large_batches_compute_the_same_weights():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    q = Int8Linear(linear)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (48,)
    assert (q.dequantized - linear.weight).abs().max() <= q.scale.max() / 2 + 1e-6  # rounding error only
    for rows in (1, SMALL_BATCH, SMALL_BATCH + 1, 40):
        x = torch.randn(rows, 64)
        expected = x @ q.dequantized.t() + linear.bias
        torch.testing.assert_close(q(x), expected, atol=1e-4, rtol=1e-4)


def test_int8_model_agrees_with_float32(loaded_model, default_model_path, hf_tokenizer):
    from services.worker.kv_cache import allocate_kv_cache
    from services.worker.loader import load_model
    from services.worker.model_runner import ModelRunner
    from tests.model_helpers import make_runner, prefill_logits
    from tests.test_llama_vs_hf import PROMPTS

    int8 = load_model(default_model_path, dtype=torch.bfloat16)
    quantize_int8(int8.model)
    assert not any(isinstance(m, nn.Linear) for m in int8.model.modules())
    fast = ModelRunner(int8.model, allocate_kv_cache(int8.config, 64, 16, torch.bfloat16), 16, 1024,
                       int8.config.eos_token_ids)
    reference = make_runner(loaded_model)
    agree = total = 0
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        ours, theirs = prefill_logits(fast, ids).float(), prefill_logits(reference, ids)
        assert ours.argmax(-1)[-1] == theirs.argmax(-1)[-1], prompt  # the next token itself
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.9, f"{agree}/{total}"
