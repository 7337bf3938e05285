"""Batching never changes a greedy request's tokens: concurrency, prefix hits, preemption. Concurrency
and prefix hits on --deterministic's torch ops (its promise); preemption and multi-step on the path
`make run` serves (the C kernels; the stack tests batch them too)."""

from __future__ import annotations

import random

import pytest

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
