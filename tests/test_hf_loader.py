"""The Hugging Face directory loader and the architecture registry, against transformers itself.

Tiny random Llama and Qwen2 checkpoints are written with transformers' own save_pretrained, then
loaded by our loader; logits must match. `dummy` builds the same shapes from config.json alone.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from tests.model_helpers import make_runner, prefill_logits

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6)


def save_tiny(tmp_path, config_cls, model_cls, **extra):
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, **extra)).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_hf_directory_matches_transformers(tmp_path, family):
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"use_sliding_window": False}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    }
    config_cls, model_cls, extra = classes[family]
    theirs = save_tiny(tmp_path, config_cls, model_cls, **extra)
    ours = load_model(str(tmp_path), ops=TORCH_OPS)
    assert ours.config.architecture == model_cls.__name__
    assert ours.config.attention_bias == (family == "qwen2")
    ids = [3, 17, 99, 4, 200, 31, 7, 7, 8, 120, 45, 2, 19, 77, 101, 5, 64, 33, 12]
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    got = prefill_logits(make_runner(ours, num_blocks=8), ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_dummy_weights_follow_the_config(tmp_path):
    save_tiny(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM)
    loaded = load_model(str(tmp_path / "config.json"), load_format="dummy", ops=TORCH_OPS)
    assert loaded.model.layers[0].attention.wqkv.weight.shape == (64 + 2 * 2 * 16, 64)  # q, k, v fused
    logits = prefill_logits(make_runner(loaded, num_blocks=4), [1, 2, 3, 4, 5])
    assert logits.shape == (5, 256) and torch.isfinite(logits).all()
