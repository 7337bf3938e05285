"""Sliding-window families against transformers: Gemma 3 (sliding layers among global ones, each
kind with its rope, four norms a layer, GeGLU, q/k norms, scaled embeddings) and Mistral (every layer
within its window).

Random weights saved by transformers for each real config's attention geometry (query and KV heads,
head size, query scalar), rope (Gemma 3 4B's linear factor 8 on its global layers), norm eps and
window, shrunk in width, depth (a sliding layer and a global one kept) and vocabulary. The
1,500-position logits cross Gemma 3's windows of 512 and 1,024 as they are; the generation and
scheduling tests shrink the window to 24 tokens, so that their 60- to 120-token contexts cross it
in decode steps, in prefill chunks and after a prefix-cache hit.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.loader import load_model
from tests.inproc_engine import InProcessEngine
from tests.model_helpers import greedy_generate, make_runner, prefill_logits

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
    "Mistral-7B-v0.1": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=32768, num_hidden_layers=2)),
}


def _saved(tmp_path_factory, name: str, window: int | None = None):
    """(transformers' model, ours) for one family, written by save_pretrained and loaded back."""
    config_cls, model_cls, geometry = REAL[name]
    fields = dict(geometry, vocab_size=VOCAB, intermediate_size=512, initializer_range=0.08)
    fields.setdefault("num_hidden_layers", len(GEMMA3_LAYERS))
    if window is not None:
        fields["sliding_window"] = window
    torch.manual_seed(0)
    theirs = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).eval()
    if model_cls.startswith("Gemma"):  # a wider init than 0 for the (1 + w) norms: the loader's offset counts
        with torch.no_grad():
            for n, p in theirs.named_parameters():
                if n.endswith("norm.weight"):
                    p.normal_(0, 0.1)
    folder = tmp_path_factory.mktemp(name)
    theirs.save_pretrained(folder, safe_serialization=True)
    return theirs, load_model(str(folder))


@pytest.fixture(scope="module", params=["gemma-3-1b-it", "gemma-3-4b-it"])
def real_window(request, tmp_path_factory):
    return _saved(tmp_path_factory, request.param)


@pytest.fixture(scope="module", params=["gemma-3-1b-it", "Mistral-7B-v0.1"])
def small_window(request, tmp_path_factory):
    return _saved(tmp_path_factory, request.param, window=24)


def test_logits_match_transformers_over_1500_positions(real_window):
    theirs, ours = real_window
    assert ours.config.architecture == "Gemma3ForCausalLM"
    assert [ours.config.window_of(i) for i in range(3)] == [theirs.config.sliding_window] * 2 + [None]
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
    _, ours = small_window
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, VOCAB, (40,), generator=gen).tolist()  # two full blocks every prompt shares
    prompts = [shared + torch.randint(0, VOCAB, (30 + 7 * i,), generator=gen).tolist() for i in range(4)]
    alone = {f"r{i}": greedy_generate(make_runner(ours, num_blocks=8), p, 24) for i, p in enumerate(prompts)}
    engine = InProcessEngine(ours, num_blocks=14, max_num_batched_tokens=64)
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, 24, min_tokens=24)
    assert engine.run() == alone
    assert engine.scheduler.num_preemptions > 0
    assert max(engine.num_cached_tokens.values()) >= 32
