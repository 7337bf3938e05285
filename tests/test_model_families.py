"""Families beyond Llama against transformers: Qwen2.5 (q/k/v biases) and Qwen3 (q/k RMSNorm).

Random weights saved by transformers for each real config's attention geometry (query and KV
heads, head size), rope theta, norm eps and tied embeddings, shrunk in width, depth and
vocabulary so a CPU runs it in seconds. Logits must match over 1,500 positions, and the
scheduler's batching, prefix cache, chunked prefill and preemption must give a lone run's tokens.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from tests import gguf_writer
from tests.model_helpers import (
    check_batched_as_alone,
    greedy_generate,
    make_runner,
    prefill_logits,
    serve_checkpoint,
    transformers_greedy,
)

transformers = pytest.importorskip("transformers")

# name: (config class, model class, the real config's geometry; width, depth and vocabulary shrunk)
REAL = {
    "Qwen2.5-0.5B-Instruct": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=896, num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=32768, use_sliding_window=False)),
    "Qwen3-0.6B": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=256, num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960)),
    "Qwen3-8B": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=40960)),
}
VOCAB = 2048


@pytest.fixture(scope="module", params=sorted(REAL))
def family(request, tmp_path_factory):
    config_cls, model_cls, geometry = REAL[request.param]
    return _saved(tmp_path_factory, request.param, config_cls, model_cls, intermediate_size=512, **geometry)


def _saved(tmp_path_factory, name: str, config_cls: str, model_cls: str, **fields):
    """(name, transformers' model, ours) for one family, written by save_pretrained and loaded back."""
    torch.manual_seed(0)
    # a wider init than training's 0.02 gives peaked next-token distributions, so greedy choices are not ties
    config = getattr(transformers, config_cls)(vocab_size=VOCAB, num_hidden_layers=2, initializer_range=0.08,
                                                **fields)
    theirs = getattr(transformers, model_cls)(config).eval()
    folder = tmp_path_factory.mktemp(name)
    theirs.save_pretrained(folder, safe_serialization=True)
    return name, theirs, load_model(str(folder), ops=TORCH_OPS)


def test_logits_match_transformers_over_1500_positions(family):
    name, theirs, ours = family
    assert ours.config.architecture == type(theirs).__name__
    ids = torch.randint(0, VOCAB, (1500,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    got = prefill_logits(make_runner(ours, num_blocks=96), ids)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)


def test_greedy_tokens_match_transformers(family):
    name, theirs, ours = family
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert greedy_generate(make_runner(ours, num_blocks=8), prompt, 24) == expected[0, len(prompt):].tolist()


def test_batching_prefix_cache_chunked_prefill_and_preemption_give_a_lone_runs_tokens(family):
    check_batched_as_alone(family[-1], VOCAB)


def write_gguf(model, path: str, arch: str) -> None:
    """The checkpoint as llama.cpp's converter writes a Qwen file (Q/K rows as they are: it permutes
    them for its llama architecture only)."""
    c = model.config
    w = gguf_writer.header(model, path, arch)
    for name, tensor in model.state_dict().items():
        stem, kind = name.rsplit(".", 1)
        if stem == "lm_head" and c.tie_word_embeddings:
            continue
        if stem.startswith("model.layers."):
            _, _, idx, rest = stem.split(".", 3)
            w.add_tensor(f"blk.{idx}.{gguf_writer.LAYER_NAMES[rest]}.{kind}", tensor.float().numpy())
        else:
            w.add_tensor(f"{gguf_writer.TOP_NAMES[stem]}.{kind}", tensor.float().numpy())
    gguf_writer.finish(w)


def test_a_gguf_written_from_the_checkpoint_loads_the_same_model(family, tmp_path):
    name, theirs, ours = family
    path = str(tmp_path / "model.gguf")
    write_gguf(theirs, path, "qwen3" if "Qwen3" in name else "qwen2")
    from_gguf = load_model(path, ops=TORCH_OPS)
    assert from_gguf.config.architecture == ours.config.architecture
    assert from_gguf.config.head_dim == ours.config.head_dim
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(prefill_logits(make_runner(from_gguf, num_blocks=16), ids),
                               prefill_logits(make_runner(ours, num_blocks=16), ids), atol=1e-5, rtol=0)


# Phi-3-mini's geometry (head size 96, as many KV heads as query heads), shrunk; the 128k variant's
# LongRoPE with 48 short and long factors, its context capped at the original 4,096 (ModelConfig)
PHI3 = dict(hidden_size=384, num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("variant", ["Phi-3-mini-4k", "Phi-3-mini-128k"])
def test_phi3_fused_projections_and_longrope_match_transformers(tmp_path, variant):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(5)
    rope = {} if variant.endswith("4k") else dict(
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", "short_factor": (1 + torch.rand(48, generator=gen)).tolist(),
                      "long_factor": (4 + 8 * torch.rand(48, generator=gen)).tolist()})
    config = transformers.Phi3Config(vocab_size=VOCAB, intermediate_size=512, num_hidden_layers=2,
                                     initializer_range=0.08, **PHI3, **rope)
    theirs = transformers.Phi3ForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_model(str(tmp_path), ops=TORCH_OPS)
    ids = torch.randint(0, VOCAB, (1500,), generator=gen).tolist()
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(make_runner(ours, num_blocks=96), ids), expected, atol=2e-4, rtol=0)
    if rope:
        assert ours.config.limit_context(131072, configured=False) == 4096
        assert ours.model.rotary.magnitude > 1.0  # transformers' attention factor on cos and sin


def _phi3(rotary: float = 1.0, longrope: bool = False):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(5)
    rope = {} if not longrope else dict(
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", "short_factor": (1 + torch.rand(int(48 * rotary), generator=gen)).tolist(),
                      "long_factor": (4 + 8 * torch.rand(int(48 * rotary), generator=gen)).tolist()})
    config = transformers.Phi3Config(vocab_size=VOCAB, intermediate_size=512, num_hidden_layers=2,
                                     initializer_range=0.08, sliding_window=None if longrope else 24,
                                     partial_rotary_factor=rotary, **PHI3, **rope)
    return transformers.Phi3ForCausalLM(config).eval()


@pytest.mark.parametrize("rotary,longrope", [(1.0, False), (0.75, False), (0.75, True)])
def test_a_phi3_gguf_as_llama_cpp_writes_it_loads_the_same_model(tmp_path, rotary, longrope):
    """Phi-3-mini-4k's geometry with its window shrunk to 24 (every layer), Phi-4-mini's partial
    rotary (three quarters), and LongRoPE as llama.cpp writes Phi-3-128k's and Phi-4-mini's (its
    factors as tensors): logits over 100 positions against transformers; the context capped at the
    original length, as from the Hugging Face directory."""
    theirs = _phi3(rotary, longrope)
    path = str(tmp_path / "phi3.gguf")
    gguf_writer.finish(gguf_writer.phi3(theirs, path))
    from_gguf = load_model(path, ops=TORCH_OPS)
    assert (from_gguf.config.architecture, from_gguf.config.sliding_window) == ("Phi3ForCausalLM",
                                                                              None if longrope else 24)
    assert from_gguf.config.rotary_dim == (72 if rotary < 1 else 0)
    if longrope:
        assert from_gguf.config.rope_scaling.rope_type == "longrope"
        assert from_gguf.config.limit_context(131072, configured=False) == 4096
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(make_runner(from_gguf, num_blocks=16), ids), expected, atol=2e-4, rtol=0)


def test_a_phi3_ggufs_fused_blocks_split_as_its_floats_do(tmp_path):
    """Kept Q8_0 blocks (--quantization gguf) of attn_qkv and ffn_up: each part's rows, dequantized,
    are the float loader's weights for that part, to the bit."""
    from services.worker.loader import gguf_blocks, gguf_file

    path = str(tmp_path / "phi3-q8.gguf")
    gguf_writer.finish(gguf_writer.phi3(_phi3(), path, q8_fused=True))
    config, floats = gguf_file.load(path)
    blocks = gguf_blocks.read(path, config)
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        part = blocks[f"layers.1.{name}.weight"]
        assert part.bits == 8 and torch.equal(part.dequantized, floats[f"layers.1.{name}.weight"]), name


def test_phi4_mini_partial_rotary_matches_transformers(tmp_path):
    """Phi-4-mini's geometry (24 query and 8 KV heads of 128, three quarters of each head rotating,
    LongRoPE's 48 short factors, tied embeddings: Phi3Config sizes a head by the width, so the width
    stays 3,072), shrunk in depth and MLP: logits over 1,500
    positions, on the torch reference and on the C kernels' path (whose rotary takes whole heads
    alone, so the partial one runs torch's)."""
    from services.worker.backends.torch_cpu.kernels.load import load as load_kernels
    from services.worker.backends.torch_cpu.ops import NATIVE_OPS

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(7)
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=3072, intermediate_size=512, num_hidden_layers=2, num_attention_heads=24,
        num_key_value_heads=8, partial_rotary_factor=0.75, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", "short_factor": (1 + torch.rand(48, generator=gen)).tolist(),
                      "long_factor": (4 + 8 * torch.rand(48, generator=gen)).tolist()},
        initializer_range=0.08, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    theirs = transformers.Phi3ForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_model(str(tmp_path), ops=TORCH_OPS)
    assert (ours.config.head_dim, ours.config.rotary_dim) == (128, 96)
    ids = torch.randint(0, VOCAB, (1500,), generator=gen).tolist()
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(make_runner(ours, num_blocks=96), ids), expected, atol=2e-4, rtol=0)
    if load_kernels().loaded:
        native = load_model(str(tmp_path), ops=NATIVE_OPS)
        prompt = ids[:40]
        assert greedy_generate(make_runner(native, num_blocks=8), prompt, 16) == \
            greedy_generate(make_runner(ours, num_blocks=8), prompt, 16)


# Mixtral-8x7B's routing (8 experts, top 2, renormalized) and Qwen3-30B-A3B's (128 experts, top 8,
# renormalized; experts narrower than the width), with their attention geometry, shrunk: 8 and 16 experts
MOE = {
    "Mixtral-8x7B": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-5,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=256)),
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, num_experts=16, num_experts_per_tok=8, moe_intermediate_size=96, intermediate_size=512,
        norm_topk_prob=True)),
}


@pytest.fixture(scope="module", params=sorted(MOE))
def moe_family(request, tmp_path_factory):
    config_cls, model_cls, geometry = MOE[request.param]
    return _saved(tmp_path_factory, request.param, config_cls, model_cls, tie_word_embeddings=False, **geometry)


def test_routed_experts_match_transformers(moe_family):
    name, theirs, ours = moe_family
    config = theirs.config
    assert ours.config.num_experts == (getattr(config, "num_local_experts", None) or config.num_experts)
    ids = torch.randint(0, VOCAB, (1500,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(make_runner(ours, num_blocks=96), ids), expected, atol=2e-4, rtol=0)


def test_routed_experts_batched_give_a_lone_runs_tokens(moe_family):
    check_batched_as_alone(moe_family[-1], VOCAB)


@pytest.mark.stack
def test_a_qwen3_directory_serves_through_the_stack(tmp_path_factory, hf_tokenizer):
    """Random Qwen3-0.6B-shaped weights with SmolLM2's tokenizer, served by `make run`'s services:
    greedy completions equal transformers' generate, and /v1/models names the architecture. (With
    vLLM's --max-logprobs -1, which the default stack does not set, so its -1 is checked here.)"""
    import httpx
    import openai

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(hf_tokenizer), intermediate_size=512, num_hidden_layers=2,
                                      initializer_range=0.08, eos_token_id=hf_tokenizer.eos_token_id,
                                      bos_token_id=hf_tokenizer.bos_token_id, **REAL["Qwen3-0.6B"][2])
    theirs = transformers.Qwen3ForCausalLM(config).eval()
    stack = serve_checkpoint(tmp_path_factory, "qwen3-test", theirs, hf_tokenizer, "--max-model-len", "4096",
                             "--max-logprobs", "-1")
    try:
        models = httpx.get(stack.base_url + "/v1/models").json()["data"]
        assert [(m["id"], m["architectures"]) for m in models] == [("qwen3-test", ["Qwen3ForCausalLM"])]
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
        prompt = "The capital of France is"
        ids = hf_tokenizer.encode(prompt)
        got = client.completions.create(model="qwen3-test", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert got.choices[0].token_ids == transformers_greedy(theirs, ids, 12)
        # --max-logprobs -1 (vLLM's): a request's -1 is every token of the vocabulary
        whole = client.chat.completions.create(model="qwen3-test", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=1, logprobs=True, top_logprobs=-1)
        assert len(whole.choices[0].logprobs.content[0].top_logprobs) == len(hf_tokenizer)
    finally:
        stack.stop()


def write_moe_gguf(model, path: str, arch: str) -> None:
    """The checkpoint as llama.cpp's converter writes a Mixtral (arch `llama`: Q/K rows permuted,
    `expert_count` set) or a Qwen3-MoE (`qwen3moe`): the router as ffn_gate_inp and each projection
    stacked over the experts (ffn_gate_exps, ffn_up_exps, ffn_down_exps)."""
    c = model.config
    width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    w = gguf_writer.header(model, path, arch)
    w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(width)
    for name, tensor in model.state_dict().items():
        t = tensor.float().numpy()
        idx = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: the gate's rows, then the up's
            w.add_tensor(f"blk.{idx}.ffn_gate_exps.weight", t[:, :width].copy())
            w.add_tensor(f"blk.{idx}.ffn_up_exps.weight", t[:, width:].copy())
        elif name.endswith("experts.down_proj"):
            w.add_tensor(f"blk.{idx}.ffn_down_exps.weight", t)
        elif idx is not None:
            rest, kind = name.split(".", 3)[3].rsplit(".", 1)
            if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                t = gguf_writer.permute(t, c.num_attention_heads if rest.endswith("q_proj") else c.num_key_value_heads)
            w.add_tensor(f"blk.{idx}.{gguf_writer.LAYER_NAMES[rest]}.{kind}", t)
        else:
            stem, kind = name.rsplit(".", 1)
            w.add_tensor(f"{gguf_writer.TOP_NAMES[stem]}.{kind}", t)
    gguf_writer.finish(w)


def test_a_moe_gguf_as_llama_cpp_writes_it_loads_the_same_model(moe_family, tmp_path):
    """Mixtral as llama.cpp writes it (a `llama` file with expert_count) and Qwen3-MoE (`qwen3moe`)."""
    name, theirs, ours = moe_family
    path = str(tmp_path / "moe.gguf")
    write_moe_gguf(theirs, path, "llama" if name.startswith("Mixtral") else "qwen3moe")
    from_gguf = load_model(path, ops=TORCH_OPS)
    assert from_gguf.config.architecture == ours.config.architecture
    assert (from_gguf.config.num_experts, from_gguf.config.num_experts_per_tok) == \
        (ours.config.num_experts, ours.config.num_experts_per_tok)
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(prefill_logits(make_runner(from_gguf, num_blocks=16), ids),
                               prefill_logits(make_runner(ours, num_blocks=16), ids), atol=1e-5, rtol=0)


def test_a_gguf_tensor_the_loader_does_not_read_is_refused_by_name():
    from services.worker.loader.gguf_file import our_name

    with pytest.raises(ValueError, match="'blk.0.attn_qkv.weight' is not one this engine reads"):
        our_name("blk.0.attn_qkv.weight")


def test_the_upload_checks_the_architectures_the_worker_implements():
    from services.worker.models.registry import _REGISTRY
    from shared.models.architectures import GGUF_ARCHITECTURES, HF_ARCHITECTURES

    assert set(_REGISTRY) == HF_ARCHITECTURES and set(GGUF_ARCHITECTURES.values()) <= HF_ARCHITECTURES


def test_an_eos_id_past_the_vocabulary_is_dropped_not_fatal(tmp_path):
    """Phi3Config's default EOS (32000) beside a smaller vocabulary: min_tokens' ban of EOS once
    indexed past the logits and failed every such request (token -1, an IndexError)."""
    config = transformers.Phi3Config(vocab_size=VOCAB, intermediate_size=512, num_hidden_layers=2,
                                     **{k: v for k, v in PHI3.items() if k != "eos_token_id"})
    assert config.eos_token_id == 32000
    transformers.Phi3ForCausalLM(config).eval().save_pretrained(tmp_path, safe_serialization=True)
    ours = load_model(str(tmp_path), ops=TORCH_OPS)
    assert ours.config.eos_token_ids == []
    tokens = greedy_generate(make_runner(ours, num_blocks=8), list(range(5, 25)), 4)
    assert len(tokens) == 4 and all(0 <= t < VOCAB for t in tokens)
