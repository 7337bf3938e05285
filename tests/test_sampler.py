"""Sampler: greedy, top-k/top-p/min-p limits, penalties, logit_bias, logprobs, batch-free seeds."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.logits_processors import SampleRow, apply_logits_processors
from services.worker.sampler import apply_top_k_top_p, sample
from shared.wire.messages import SamplingParams

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0]])


def row(params: SamplingParams, seed: int = 0, index: int = 0, **kw) -> SampleRow:
    return SampleRow(params=params, seed=seed, output_index=index, **kw)


def draw(params: SamplingParams, seed: int, index: int = 0, logits=LOGITS) -> int:
    return sample(logits.clone(), [row(params, seed, index)])[0][0]


def test_greedy_and_top_k_one_pick_the_argmax():
    assert draw(SamplingParams(temperature=0.0), seed=1) == 1
    assert all(draw(SamplingParams(temperature=1.5, top_k=1), seed=s) == 1 for s in range(20))


def test_top_p_keeps_the_smallest_set_reaching_p():
    kept = apply_top_k_top_p(LOGITS[0], top_k=0, top_p=0.7)  # probs: .62 .23 .08 .05 .01
    assert torch.isfinite(kept).tolist() == [False, True, True, False, False]
    draws = {draw(SamplingParams(temperature=1.0, top_p=0.7), seed=s) for s in range(50)}
    assert draws == {1, 2}


def test_min_p_keeps_tokens_near_the_best():
    # probs by token: .08 .62 .23 .05 .01; min_p .3 keeps p >= .187 -> tokens 1 and 2
    kept = apply_top_k_top_p(LOGITS[0], top_k=0, top_p=1.0, min_p=0.3)
    assert torch.isfinite(kept).tolist() == [False, True, True, False, False]
    assert {draw(SamplingParams(temperature=1.0, min_p=0.3), seed=s) for s in range(50)} == {1, 2}


def test_seed_gives_the_same_draw_whatever_the_batch():
    params = SamplingParams(temperature=1.0)
    alone = [draw(params, seed=42, index=i) for i in range(10)]
    batch_logits = torch.cat([torch.randn(3, 5), LOGITS])
    in_batch = [sample(batch_logits.clone(), [row(params, s, i) for s in (7, 8, 9, 42)])[0][3] for i in range(10)]
    assert alone == in_batch
    assert len(set(alone)) > 1  # the index advances the draw


def test_banned_ids_are_never_drawn():
    ids, _ = sample(LOGITS.clone(), [row(SamplingParams(temperature=0.0), banned_ids=[1, 2])])
    assert ids == [0]


def test_logit_bias_adds_to_the_chosen_tokens():
    out = apply_logits_processors(LOGITS.clone(), [row(SamplingParams(logit_bias={4: 10.0, 1: -100.0}))])
    assert out[0].tolist() == [1.0, -97.0, 2.0, 0.5, 9.0]


def test_presence_frequency_and_repetition_penalties():
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_logits_processors(LOGITS.clone(), [row(p, output_ids=[2, 2, 3])])
    # token 2 seen twice: 2 - 0.5 - 0.5; token 3 once: 0.5 - 0.5 - 0.25
    assert out[0].tolist() == [1.0, 3.0, 1.0, -0.25, -1.0]
    rep = SamplingParams(repetition_penalty=2.0)
    out = apply_logits_processors(LOGITS.clone(), [row(rep, prompt_ids=[1], output_ids=[4])])
    # positive logits are divided, negative multiplied, for tokens in the prompt or the output
    assert out[0].tolist() == [1.0, 1.5, 2.0, 0.5, -2.0]


def test_logprobs_are_the_models_raw_distribution():
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={0: 50.0})
    ids, logprobs = sample(LOGITS.clone(), [row(params)])
    expected = LOGITS[0].log_softmax(-1)
    assert ids == [0]  # the bias decided the draw ...
    lp = logprobs[0]
    assert math.isclose(lp.logprob, expected[0].item(), rel_tol=1e-6)  # ... not the reported logprob
    assert lp.top_ids == [1, 2]
    assert [round(v, 5) for v in lp.top_logprobs] == [round(expected[1].item(), 5), round(expected[2].item(), 5)]
    _, none = sample(LOGITS.clone(), [row(SamplingParams(temperature=0.0))])
    assert none == [None]


def test_logprob_token_ids_are_the_named_tokens_and_the_chosen_once():
    expected = LOGITS[0].log_softmax(-1)
    named = SamplingParams(temperature=0.0, logprobs=2, logprob_token_ids=[4, 3, 4], allowed_token_ids=[1])
    ids, logprobs = sample(LOGITS.clone(), [row(named)])
    assert ids == [1]
    assert logprobs[0].top_ids == [4, 3, 1]  # each once, the chosen after the named, no top-k
    assert logprobs[0].top_logprobs == pytest.approx([expected[i].item() for i in (4, 3, 1)])
    inside = SamplingParams(temperature=0.0, logprobs=0, logprob_token_ids=[1, 4], allowed_token_ids=[1])
    assert sample(LOGITS.clone(), [row(inside)])[1][0].top_ids == [1, 4]
