"""Sampler: greedy, top-k/top-p limits, and seeds that do not depend on the batch."""

from __future__ import annotations

import torch

from services.worker.sampler import apply_top_k_top_p, sample
from shared.messages import SamplingParams

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0]])


def draw(params: SamplingParams, seed: int, index: int = 0, logits=LOGITS) -> int:
    return sample(logits.clone(), [params], [seed], [index], [[]])[0]


def test_greedy_and_top_k_one_pick_the_argmax():
    assert draw(SamplingParams(temperature=0.0), seed=1) == 1
    assert all(draw(SamplingParams(temperature=1.5, top_k=1), seed=s) == 1 for s in range(20))


def test_top_p_keeps_the_smallest_set_reaching_p():
    kept = apply_top_k_top_p(LOGITS[0], top_k=0, top_p=0.7)  # probs: .62 .23 .08 .05 .01
    assert torch.isfinite(kept).tolist() == [False, True, True, False, False]
    draws = {draw(SamplingParams(temperature=1.0, top_p=0.7), seed=s) for s in range(50)}
    assert draws == {1, 2}


def test_seed_gives_the_same_draw_whatever_the_batch():
    params = SamplingParams(temperature=1.0)
    alone = [draw(params, seed=42, index=i) for i in range(10)]
    batch_logits = torch.cat([torch.randn(3, 5), LOGITS])
    in_batch = [sample(batch_logits.clone(), [params] * 4, [7, 8, 9, 42], [i] * 4, [[]] * 4)[3] for i in range(10)]
    assert alone == in_batch
    assert len(set(alone)) > 1  # the index advances the draw


def test_banned_ids_are_never_drawn():
    out = sample(LOGITS.clone(), [SamplingParams(temperature=0.0)], [0], [0], [[1, 2]])
    assert out == [0]
