"""oneDNN's packed float32 and bfloat16 Linears (what the served models run) against plain F.linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.worker.backends.torch_cpu import dense

pytestmark = pytest.mark.skipif(not dense.available(torch.float32), reason="torch built without oneDNN")


def test_packed_linear_matches_f_linear_for_every_batch_size():
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=True)
    packed = dense.PackedLinear(linear)
    assert torch.equal(packed.packed.to_dense(), linear.weight)
    for rows in (1, 2, 7, 16, 64, 130):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert packed(torch.randn(2, 3, 96)).shape == (2, 3, 80)


@pytest.mark.skipif(not dense.available(torch.bfloat16), reason="oneDNN has no bf16 instructions on this CPU")
def test_packed_bfloat16_linear_matches_f_linear():
    """Both sum in float32 and round the result to bfloat16; the order of the sums may differ."""
    torch.manual_seed(0)
    linear = nn.Linear(576, 160, bias=False).to(torch.bfloat16)
    packed = dense.PackedLinear(linear)
    assert packed.packed.dtype == torch.bfloat16 and torch.equal(packed.packed.to_dense(), linear.weight)
    for rows in (1, 8, 16, 64):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        torch.testing.assert_close(packed(x).float(), linear(x).float(), atol=2e-2, rtol=2e-2)


def test_packed_model_matches_the_plain_one(loaded_model, default_model_path, hf_tokenizer):
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.loader import load_model
    from tests.model_helpers import greedy_generate, make_runner, prefill_logits
    from tests.test_llama_vs_hf import PROMPTS

    packed = load_model(default_model_path, ops=TORCH_OPS)
    dense.pack_linears(packed.model)
    assert not any(isinstance(m, nn.Linear) for m in packed.model.modules())
    fast, reference = make_runner(packed), make_runner(loaded_model)
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        torch.testing.assert_close(prefill_logits(fast, ids), prefill_logits(reference, ids), atol=1e-3, rtol=1e-4)
        assert greedy_generate(fast, ids, max_tokens=16) == greedy_generate(reference, ids, max_tokens=16), prompt
