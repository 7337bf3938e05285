"""oneDNN's packed float32 Linears (what the served float32 model runs) against plain F.linear."""

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


def test_packed_model_matches_the_plain_one(loaded_model, default_model_path, hf_tokenizer):
    from services.worker.loader import load_model
    from tests.model_helpers import greedy_generate, make_runner, prefill_logits
    from tests.test_llama_vs_hf import PROMPTS

    packed = load_model(default_model_path)
    dense.pack_linears(packed.model)
    assert not any(isinstance(m, nn.Linear) for m in packed.model.modules())
    fast, reference = make_runner(packed), make_runner(loaded_model)
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        torch.testing.assert_close(prefill_logits(fast, ids), prefill_logits(reference, ids), atol=1e-3, rtol=1e-4)
        assert greedy_generate(fast, ids, max_tokens=16) == greedy_generate(reference, ids, max_tokens=16), prompt
