"""Batching never changes a greedy request's tokens: concurrency, prefix hits, preemption. Concurrency
and prefix hits on --deterministic's torch ops (its promise); preemption and multi-step on the path
`make run` serves (the C kernels; the stack tests batch them too), where a request's logprobs are
the same bits cached, chunked or batched, with float32 rows and with --quant-activations int8."""

from __future__ import annotations

import random

import pytest

from bench.dataset import CHAT_QUESTIONS
from tests.inproc_engine import InProcessEngine


@pytest.fixture(scope="module")
def prompts(hf_tokenizer):
    rng = random.Random(7)
    words = "the of and to in is was for on that with as by at from it his an were are which".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 90))) for _ in range(16)]
    return [hf_tokenizer.encode(t) for t in texts]


def alone(loaded_model, prompt_ids, max_tokens):
    engine = InProcessEngine(loaded_model, num_blocks=64)
    engine.add("solo", prompt_ids, max_tokens)
    return engine.run()["solo"]


def test_sixteen_concurrent_match_alone(loaded_model, prompts):
    engine = InProcessEngine(loaded_model, num_blocks=256, max_num_batched_tokens=128)
    max_tokens = [4 + (i * 5) % 20 for i in range(16)]
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, max_tokens[i])
    batched = engine.run()
    assert engine.scheduler.kv.pool.num_free == 256  # everything freed
    for i, p in enumerate(prompts):
        assert batched[f"r{i}"] == alone(loaded_model, p, max_tokens[i]), f"r{i}"


def test_prefix_cache_hit_gives_cold_tokens(loaded_model, prompts):
    shared = prompts[0] * 3  # > 2 full blocks of shared prefix
    engine = InProcessEngine(loaded_model, num_blocks=128)
    engine.add("cold", shared + [1001, 1002], 12)
    cold = engine.run()["cold"]
    engine.add("warm", shared + [1001, 1002], 12)
    warm = engine.run()["warm"]
    assert engine.num_cached_tokens["cold"] == 0
    assert engine.num_cached_tokens["warm"] == (len(shared) + 2 - 1) // 16 * 16 > 0
    assert warm == cold


def test_preempted_request_recomputes_same_tokens(served_model, prompts):
    # 12 blocks of 16 tokens cannot hold three ~60-token prompts growing by 40 tokens each
    engine = InProcessEngine(served_model, num_blocks=12, max_num_batched_tokens=256)
    chosen = [p[:60] for p in prompts if len(p) >= 60][:3]
    for i, p in enumerate(chosen):
        engine.add(f"p{i}", p, 40)
    outputs = engine.run()
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(chosen):
        assert outputs[f"p{i}"] == alone(served_model, p, 40), f"p{i}"


@pytest.mark.parametrize("num_blocks", [256, 12])  # 12: rows preempted between multi-step Steps
def test_multi_step_gives_the_same_tokens_in_fewer_steps(served_model, prompts, num_blocks):
    chosen = prompts if num_blocks == 256 else [p[:60] for p in prompts if len(p) >= 60][:3]
    max_tokens = [3 + (i * 5) % 23 for i in range(len(chosen))] if num_blocks == 256 else [40] * len(chosen)
    runs = {}
    for num_scheduler_steps in (1, 4):
        engine = InProcessEngine(served_model, num_blocks=num_blocks, max_num_batched_tokens=256,
                                 num_scheduler_steps=num_scheduler_steps)
        for i, p in enumerate(chosen):
            engine.add(f"r{i}", p, max_tokens[i])
        runs[num_scheduler_steps] = engine.run(), engine.steps_run
        assert engine.scheduler.kv.pool.num_free == num_blocks  # lookahead slots freed too
        if num_blocks == 12:
            assert engine.scheduler.num_preemptions > 0
    (single, single_steps), (multi, multi_steps) = runs[1], runs[4]
    assert multi == single
    assert all(len(multi[f"r{i}"]) <= max_tokens[i] for i in range(len(chosen)))
    # with room, decode runs 4 iterations a Step; under preemption, only while nothing waits
    assert multi_steps < single_steps * (0.5 if num_blocks == 256 else 1.0), (multi_steps, single_steps)


@pytest.fixture(scope="module")
def int8_rows_model(default_model_path, cpu_kernels):
    """served_model with --quant-activations int8 (its own copy: the switch changes the model's Linears)."""
    from services.worker.backends.spec import WorkerSpec
    from services.worker.backends.torch_cpu.backend import load_as_filed
    from services.worker.backends.torch_cpu.quantization import int8_activations

    loaded = load_as_filed(default_model_path, WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: 0),
                           native=True)
    assert int8_activations(loaded.model) > 0
    return loaded


@pytest.mark.parametrize("rows", ["float32", "int8"])
def test_logprobs_are_the_same_bits_cached_chunked_or_batched(request, hf_tokenizer, rows):
    """Chat prompts (one system prompt: each after the first finds it cached) asked one by one, then
    again (all but their last block cached), then all at once in chunks of 40 tokens: every sampled
    token's logprob is its lone run's, to the bit. A prompt's rows are each computed as its decode
    would be (prefill_attention), whatever was cached or beside it; int8 rows would round a last-bit
    difference to another int8 step and change the answer."""
    model = request.getfixturevalue("served_model" if rows == "float32" else "int8_rows_model")
    chats = [hf_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=False) for q in CHAT_QUESTIONS[:6]]
    prompts = [hf_tokenizer.encode(c, add_special_tokens=False) for c in chats]

    def lone(prompt_ids):
        engine = InProcessEngine(model, num_blocks=64)
        engine.add("solo", prompt_ids, 8, logprobs=0)
        engine.run()
        return engine.logprobs["solo"]

    expected = {f"{i}": lone(p) for i, p in enumerate(prompts)}
    cached = InProcessEngine(model, num_blocks=256)
    for again in ("", "again"):
        for i, p in enumerate(prompts):
            cached.add(f"{i}{again}", p, 8, logprobs=0)
            cached.run()
    assert cached.num_cached_tokens["1"] > 0 and all(cached.num_cached_tokens[f"{i}again"] > 0 for i in range(6))
    chunked = InProcessEngine(model, num_blocks=256, max_num_batched_tokens=40)
    for i, p in enumerate(prompts):
        chunked.add(f"{i}", p, 8, logprobs=0)
    chunked.run()
    for i in range(6):
        assert cached.logprobs[f"{i}"] == cached.logprobs[f"{i}again"] == chunked.logprobs[f"{i}"] == expected[f"{i}"], i
