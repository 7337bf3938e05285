"""Sliding-window families against transformers: Gemma 3 (sliding layers among global ones, each
kind with its rope, four norms a layer, GeGLU, q/k norms, scaled embeddings), Gemma 2 (the same
layers, every other one global, soft caps on attention scores and logits in place of the q/k norms)
and Mistral (every layer within its window).

Random weights saved by transformers for each real config's attention geometry (query and KV heads,
head size, query scalar), rope (Gemma 3 4B's linear factor 8 on its global layers), norm eps and
window, shrunk in width, depth (a sliding layer and a global one kept) and vocabulary. The
1,500-position logits cross Gemma 3's windows of 512 and 1,024 as they are; the generation and
scheduling tests shrink the window to 24 tokens, so that their 60- to 120-token contexts cross it
in decode steps, in prefill chunks and after a prefix-cache hit; there Gemma 2's caps (50 and 30,
which random weights' scores never near) are lowered to 1.5 and 3, so that they bite.
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
VOCAB = 2048
GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"]  # 5 : 1 in the real ones
LOCAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

REAL = {  # name: (config class, model class, the real config's geometry; width, depth and vocabulary shrunk)
    "gemma-3-1b-it": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, layer_types=GEMMA3_LAYERS, rms_norm_eps=1e-6, max_position_embeddings=32768,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": LOCAL_ROPE})),
    "gemma-3-4b-it": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=1024, layer_types=GEMMA3_LAYERS, rms_norm_eps=1e-6, max_position_embeddings=131072,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": LOCAL_ROPE})),
    "gemma-2-2b-it": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "Mistral-7B-v0.1": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=32768, num_hidden_layers=2)),
    "Phi-3-mini-4k-instruct": ("Phi3Config", "Phi3ForCausalLM", dict(  # heads of 96
        hidden_size=384, num_attention_heads=4, num_key_value_heads=4, sliding_window=2047, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=4096, num_hidden_layers=2, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


def _saved(tmp_path_factory, name: str, window: int | None = None, ops=TORCH_OPS):
    """(transformers' model, ours) for one family, written by save_pretrained and loaded back on `ops`;
    with `window`, the window shrunk (and Gemma 2's caps lowered)."""
    config_cls, model_cls, geometry = REAL[name]
    fields = dict(geometry, vocab_size=VOCAB, intermediate_size=512, initializer_range=0.08)
    fields.setdefault("num_hidden_layers", len(GEMMA3_LAYERS))
    if window is not None:
        fields["sliding_window"] = window
        if "attn_logit_softcapping" in fields:
            fields.update(attn_logit_softcapping=1.5, final_logit_softcapping=3.0)
    torch.manual_seed(0)
    theirs = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).eval()
    if model_cls.startswith("Gemma"):  # a wider init than 0 for the (1 + w) norms: the loader's offset counts
        with torch.no_grad():
            for n, p in theirs.named_parameters():
                if n.endswith("norm.weight"):
                    p.normal_(0, 0.1)
    folder = tmp_path_factory.mktemp(name)
    theirs.save_pretrained(folder, safe_serialization=True)
    return theirs, load_model(str(folder), ops=ops)


@pytest.fixture(scope="module", params=["gemma-3-1b-it", "gemma-3-4b-it", "gemma-2-2b-it"])
def real_window(request, tmp_path_factory):
    return _saved(tmp_path_factory, request.param)


@pytest.fixture(scope="module", params=["gemma-3-1b-it", "gemma-2-2b-it", "Mistral-7B-v0.1"])
def small_window(request, tmp_path_factory):
    return _saved(tmp_path_factory, request.param, window=24)


def test_logits_match_transformers_over_1500_positions(real_window):
    theirs, ours = real_window
    assert ours.config.architecture == type(theirs).__name__
    windows = [theirs.config.sliding_window if t == "sliding_attention" else None for t in theirs.config.layer_types]
    assert [ours.config.window_of(i) for i in range(len(windows))] == windows
    ids = torch.randint(0, VOCAB, (1500,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    got = prefill_logits(make_runner(ours, num_blocks=96), ids)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)


def test_greedy_tokens_match_transformers_past_the_window(small_window):
    theirs, ours = small_window
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert greedy_generate(make_runner(ours, num_blocks=8), prompt, 24) == expected[0, len(prompt):].tolist()


def test_batching_prefix_cache_chunked_prefill_and_preemption_give_a_lone_runs_tokens(small_window):
    check_batched_as_alone(small_window[-1], VOCAB)


@pytest.mark.parametrize("name", ["gemma-3-1b-it", "gemma-2-2b-it", "Mistral-7B-v0.1", "Phi-3-mini-4k-instruct"])
def test_on_the_c_kernels_every_logprob_is_a_lone_runs_bits(tmp_path_factory, cpu_kernels, name):
    """The fast path (the C kernels' attention, here with 8-bit weights on quant_linear, whose rows are
    each their own sums): windowed and soft-capped layers of head sizes 256, 128 and 96 too. Prompts
    sharing 40 tokens, alone, then one after another (the shared blocks cached), then all at once in
    chunks of 32 tokens: every sampled token's logprob the lone run's to the bit, past the window of
    24 in prefill chunks and decode steps; and the greedy tokens transformers' (fast path, float32)."""
    from services.worker.backends.torch_cpu.ops import NATIVE_OPS
    from services.worker.backends.torch_cpu.quantization import quantize
    from tests.inproc_engine import InProcessEngine

    theirs, ours = _saved(tmp_path_factory, name, window=24, ops=NATIVE_OPS)
    assert greedy_generate(make_runner(ours, num_blocks=8), list(range(5, 45)), 16) == \
        transformers_greedy(theirs, list(range(5, 45)), 16)
    quantize(ours.model, "int8")
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (20 + 9 * i,), generator=gen).tolist() for i in range(4)]

    def lone(prompt):
        engine = InProcessEngine(ours, num_blocks=16)
        engine.add("solo", prompt, 12, logprobs=0, min_tokens=12)
        engine.run()
        return engine.logprobs["solo"]

    expected = [lone(p) for p in prompts]
    cached = InProcessEngine(ours, num_blocks=64)
    for i, p in enumerate(prompts):
        cached.add(f"{i}", p, 12, logprobs=0, min_tokens=12)
        cached.run()
    assert all(cached.num_cached_tokens[f"{i}"] >= 32 for i in range(1, 4))
    chunked = InProcessEngine(ours, num_blocks=64, max_num_batched_tokens=32)
    for i, p in enumerate(prompts):
        chunked.add(f"{i}", p, 12, logprobs=0, min_tokens=12)
    chunked.run()
    assert [cached.logprobs[f"{i}"] for i in range(4)] == [chunked.logprobs[f"{i}"] for i in range(4)] == expected


# Gemma normalizes after attention and after the MLP too: its names for the four norms
GGUF_GEMMA = gguf_writer.LAYER_NAMES | {"post_attention_layernorm": "post_attention_norm",
                                        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_gemma_gguf(model, path: str, arch: str) -> None:
    """The checkpoint as llama.cpp's converter writes a gemma2 or gemma3 file: its tensor names, each
    norm weight with the 1 added, the window and soft caps as metadata (the layer pattern and local
    rope base are llama.cpp's fixed ones)."""
    c = model.config
    w = gguf_writer.header(model, path, arch)
    w.add_sliding_window(c.sliding_window)
    if c.attn_logit_softcapping is not None:
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    for name, tensor in model.state_dict().items():
        stem, kind = name.rsplit(".", 1)
        if stem == "lm_head":
            continue  # tied
        t = tensor.float() + 1 if stem.endswith("norm") else tensor.float()
        if stem.startswith("model.layers."):
            _, _, idx, rest = stem.split(".", 3)
            w.add_tensor(f"blk.{idx}.{GGUF_GEMMA[rest]}.{kind}", t.numpy())
        else:
            w.add_tensor(f"{gguf_writer.TOP_NAMES[stem]}.{kind}", t.numpy())
    gguf_writer.finish(w)


@pytest.mark.parametrize("arch,name,windows", [("gemma3", "gemma-3-1b-it", [24] * 5 + [None]),
                                               ("gemma2", "gemma-2-2b-it", [24, None] * 3)])
def test_a_gemma_gguf_as_llama_cpp_writes_it_loads_the_same_model(tmp_path_factory, arch, name, windows):
    """Six layers, so llama.cpp's fixed patterns (every sixth layer global; every other) are the config's."""
    config_cls, model_cls, geometry = REAL[name]
    fields = dict(geometry, vocab_size=VOCAB, intermediate_size=256, hidden_size=128, num_hidden_layers=6,
                  sliding_window=24)
    del fields["layer_types"]  # transformers derives them
    if arch == "gemma2":
        fields.update(attn_logit_softcapping=1.5, final_logit_softcapping=3.0)
    torch.manual_seed(0)
    theirs = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).eval()
    path = str(tmp_path_factory.mktemp(f"{arch}-gguf") / "model.gguf")
    write_gemma_gguf(theirs, path, arch)
    ours = load_model(path, ops=TORCH_OPS)
    assert ours.config.architecture == model_cls
    assert [ours.config.window_of(i) for i in range(6)] == windows
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(make_runner(ours, num_blocks=16), ids), expected, atol=2e-4, rtol=0)


@pytest.mark.stack
def test_a_gemma3_directory_serves_through_the_stack_with_the_default_path(tmp_path_factory, hf_tokenizer):
    """Random Gemma-3-1B-shaped weights (window shrunk to 24) with SmolLM2's tokenizer, served by
    `make run`'s services on their defaults (the C kernels where they apply): a greedy completion
    past the window equals transformers' generate, and /v1/models names the architecture."""
    import httpx
    import openai

    config_cls, model_cls, geometry = REAL["gemma-3-1b-it"]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**dict(
        geometry, vocab_size=len(hf_tokenizer), intermediate_size=512, initializer_range=0.08, sliding_window=24,
        num_hidden_layers=len(GEMMA3_LAYERS), eos_token_id=hf_tokenizer.eos_token_id,
        bos_token_id=hf_tokenizer.bos_token_id, pad_token_id=hf_tokenizer.eos_token_id))
    theirs = getattr(transformers, model_cls)(config).eval()
    stack = serve_checkpoint(tmp_path_factory, "gemma3-test", theirs, hf_tokenizer, "--max-model-len", "4096")
    try:
        models = httpx.get(stack.base_url + "/v1/models").json()["data"]
        assert [(m["id"], m["architectures"]) for m in models] == [("gemma3-test", ["Gemma3ForCausalLM"])]
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
        prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
        ids = hf_tokenizer.encode(prompt)
        got = client.completions.create(model="gemma3-test", prompt=prompt, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert len(ids) + 16 > 24  # decode steps past the window
        assert got.choices[0].token_ids == transformers_greedy(theirs, ids, 16)
    finally:
        stack.stop()
