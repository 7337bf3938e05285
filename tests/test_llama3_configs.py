"""Llama 3.x configs (rope scaling 'llama3', theta 500000, GQA) against transformers, in the
spelling transformers 5 writes (`rope_parameters`) and the older one (`rope_scaling` beside
`rope_theta`); and the config fields we do not implement, refused by name.

Random weights saved by transformers for each real config's rope and attention geometry (head
size, query/KV head ratio, theta, scaling, norm eps, tied embeddings), shrunk in width, depth and
vocabulary so a CPU runs it in seconds.
"""

from __future__ import annotations

import json

import pytest
import torch

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from services.worker.model_config import ModelConfig
from services.worker.rope import RopeScaling, inv_freq
from shared.config import ConfigError
from tests import gguf_writer
from tests.model_helpers import make_runner, prefill_logits

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# name: (head_dim, query heads per KV head, rope factor, tied embeddings) of the real config
REAL = {
    "Llama-3.1-8B": (128, 4, 8.0, False),
    "Llama-3.2-1B": (64, 4, 32.0, True),
    "Llama-3.3-70B": (128, 8, 8.0, False),
}


def _save(tmp_path, name: str, spelling: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    head_dim, group, factor, tied = REAL[name]
    config = LlamaConfig(vocab_size=512, hidden_size=2 * group * head_dim, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=2 * group, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                         rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "factor": factor},
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path / f"{name}-{spelling}"
    model.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in raw  # what transformers 5 writes
    if spelling == "transformers4":
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = params
        (path / "config.json").write_text(json.dumps(raw))
    return model, path


@pytest.mark.parametrize("spelling", ["transformers5", "transformers4"])
@pytest.mark.parametrize("name", list(REAL))
def test_llama3_matches_transformers_past_the_scaled_wavelengths(tmp_path, name, spelling):
    hf, path = _save(tmp_path, name, spelling)
    loaded = load_model(str(path), ops=TORCH_OPS)
    assert loaded.config.rope_theta == 500000.0 and loaded.config.rope_scaling.rope_type == "llama3"
    ids = torch.randint(3, 512, (1500,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prefill_logits(make_runner(loaded, num_blocks=128), ids)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-3)
    # the test can fail: unscaled frequencies (what such a config served as before) move the logits
    plain = load_model(str(path), ops=TORCH_OPS)
    plain.model.rotary.inv_freq = inv_freq(plain.config.head_dim, 500000.0, RopeScaling())
    wrong = prefill_logits(make_runner(plain, num_blocks=128), ids)
    assert (wrong - theirs).abs().max() > 100 * (ours - theirs).abs().max()


def test_inverse_frequencies_equal_transformers_own():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=500000.0,
                         max_position_embeddings=131072, rope_scaling={**LLAMA3_ROPE, "factor": 8.0})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inv_freq(128, 500000.0, RopeScaling(factor=8.0, **{k: v for k, v in LLAMA3_ROPE.items()
                                                                if k != "rope_type"}, rope_type="llama3"))
    assert torch.equal(ours, theirs.float())


def _config_with(tmp_path, **fields) -> str:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, **fields}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.mark.parametrize("fields,message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope type 'yarn' is not implemented"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not implemented"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3' needs"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}}, r"\['beta_fast'\] are not implemented"),
    ({"mlp_bias": True}, "mlp_bias is not implemented"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not implemented"),
    ({"attn_chunk_size": 8192, "use_qk_norm": True}, r"\['attn_chunk_size', 'use_qk_norm'\] are not implemented"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor 1.5 is out of range"),
])
def test_config_fields_we_do_not_implement_are_refused_by_name(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(_config_with(tmp_path, **fields))


def test_both_spellings_of_theta_and_linear_scaling_are_read(tmp_path):
    new = ModelConfig.from_hf_config(_config_with(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert new.rope_theta == 1e6 and new.rope_scaling == RopeScaling()
    old = ModelConfig.from_hf_config(_config_with(tmp_path, rope_theta=2e5, rope_scaling={"type": "linear", "factor": 2.0}))
    assert old.rope_theta == 2e5 and old.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    assert torch.equal(inv_freq(16, 2e5, old.rope_scaling), inv_freq(16, 2e5, RopeScaling()) / 2)


def test_sliding_windows_are_served_per_layer_as_transformers_derives_them(tmp_path):
    mistral = ModelConfig.from_hf_config(_config_with(tmp_path, architectures=["MistralForCausalLM"], num_hidden_layers=2,
                                                      sliding_window=4096, max_position_embeddings=32768))
    assert mistral.limit_context(32768, configured=False) == 32768  # windowed attention is exact past the window
    assert [mistral.window_of(i) for i in range(2)] == [4096, 4096]
    qwen = ModelConfig.from_hf_config(_config_with(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                                                   use_sliding_window=False))
    assert qwen.sliding_window is None and qwen.window_of(0) is None
    qwen = ModelConfig.from_hf_config(_config_with(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                                                   use_sliding_window=True, max_window_layers=1, num_hidden_layers=2))
    assert [qwen.window_of(i) for i in range(2)] == [None, 4096]  # from max_window_layers on
    gemma = ModelConfig.from_hf_config(_config_with(  # transformers 4's Gemma 3 config: no layer_types
        tmp_path, architectures=["Gemma3ForCausalLM"], num_hidden_layers=12, sliding_window=512,
        sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4, hidden_activation="gelu_pytorch_tanh",
        rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert [gemma.window_of(i) for i in range(12)] == ([512] * 5 + [None]) * 2
    assert (gemma.rope_theta, gemma.local_rope_theta, gemma.rope_scaling.factor) == (1e6, 1e4, 8.0)
    with pytest.raises(ConfigError, match="layer_types must name 2 layers"):
        ModelConfig.from_hf_config(_config_with(tmp_path, architectures=["MistralForCausalLM"], sliding_window=64,
                                                num_hidden_layers=2, layer_types=["chunked_attention"] * 2))
    with pytest.raises(ConfigError, match="sliding layers' rope_parameters"):
        ModelConfig.from_hf_config(_config_with(tmp_path, architectures=["Gemma3ForCausalLM"], sliding_window=64, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}))


def test_rotary_frequencies_stay_float32_in_a_bfloat16_model(tmp_path):
    _, path = _save(tmp_path, "Llama-3.2-1B", "transformers5")
    loaded = load_model(str(path), dtype=torch.bfloat16, ops=TORCH_OPS)
    assert loaded.model.tok_embeddings.weight.dtype == torch.bfloat16
    assert loaded.model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(loaded.model.rotary.inv_freq, inv_freq(64, 500000.0, loaded.config.rope_scaling))


def _write_gguf(hf_model, path, rope_freqs: torch.Tensor | None, scaling_type: str | None = None) -> str:
    """The model's weights as llama.cpp lays them out (Q/K rows permuted for its rotary), F32."""
    import gguf
    import numpy as np

    cfg = hf_model.config
    writer = gguf_writer.header(hf_model, str(path), "llama")
    writer.add_rope_dimension_count(cfg.head_dim)
    if scaling_type is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling_type))
        writer.add_rope_scaling_factor(2.0)
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy()
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, i, rest = stem.split(".", 3)
            if rest in ("self_attn.q_proj", "self_attn.k_proj"):
                w = gguf_writer.permute(w, cfg.num_attention_heads if rest.endswith("q_proj") else cfg.num_key_value_heads)
            out = f"blk.{i}.{gguf_writer.LAYER_NAMES[rest]}.{kind}"
        else:
            out = f"{gguf_writer.TOP_NAMES[stem]}.{kind}"
        writer.add_tensor(out, np.ascontiguousarray(w))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.numpy())
    gguf_writer.finish(writer)
    return str(path)


def test_a_gguf_with_rope_freqs_matches_transformers(tmp_path, monkeypatch):
    """llama.cpp writes Llama 3.1+'s scaling as a rope_freqs tensor: each frequency's divisor."""
    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path / "cache"))
    hf, _ = _save(tmp_path, "Llama-3.1-8B", "transformers5")
    scaling = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    divisors = inv_freq(128, 500000.0, RopeScaling()) / inv_freq(128, 500000.0, scaling)
    loaded = load_model(_write_gguf(hf, tmp_path / "llama31.gguf", divisors), ops=TORCH_OPS)
    assert loaded.config.rope_freq_factors is not None
    ids = torch.randint(3, 512, (1500,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prefill_logits(make_runner(loaded, num_blocks=128), ids)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-3)
    loaded.model.rotary.inv_freq = inv_freq(128, 500000.0, RopeScaling())  # the tensor ignored
    assert (prefill_logits(make_runner(loaded, num_blocks=128), ids) - theirs).abs().max() > 100 * 2e-4


def test_gguf_rope_scaling_types(tmp_path):
    fields = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
              "llama.feed_forward_length": 128, "llama.block_count": 1, "llama.vocab_size": 32}
    assert ModelConfig.from_gguf_fields({**fields, "llama.rope.scaling.type": "linear",
                                         "llama.rope.scaling.factor": 4.0}, True).rope_scaling == \
        RopeScaling(rope_type="linear", factor=4.0)
    with pytest.raises(ConfigError, match="GGUF rope scaling 'yarn' is not implemented"):
        ModelConfig.from_gguf_fields({**fields, "llama.rope.scaling.type": "yarn"}, True)
