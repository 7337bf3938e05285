"""Sampling on the worker: greedy, temperature, top-k, top-p, min-p, a seed per request, logprobs.

Random draws come from a generator seeded with (request seed, output index), so a request's
tokens do not depend on what else is in the batch, nor on being preempted and recomputed.
Logprobs are the model's own (log-softmax of the raw logits, before any processor), as vLLM
reports them by default.
"""

from __future__ import annotations

import torch

from services.worker.logits_processors import SampleRow, apply_logits_processors
from shared.wire.messages import Logprobs

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive indices apart


def draw_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 + output_index * _MIX) & 0x7FFF_FFFF_FFFF_FFFF


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """logits: [vocab] already temperature-scaled; returns logits with cut tokens at -inf."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        # keep tokens at least min_p times as likely as the most likely one
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def logprobs_of(logprobs: torch.Tensor, token_ids: list[int], num_top: int,
                named: list[int] | None = None) -> list[Logprobs]:
    """logprobs: [n, vocab] log-softmax rows; the chosen token's value and the num_top best, or
    (named: vLLM's logprob_token_ids) those tokens' values and the chosen one's, each once."""
    chosen_t = logprobs.gather(1, torch.tensor(token_ids, dtype=torch.long).unsqueeze(1))
    ranks = ((logprobs > chosen_t).sum(-1) + 1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    if named:
        out = []
        for row, (token_id, lp, r) in enumerate(zip(token_ids, chosen, ranks, strict=True)):
            ids = list(dict.fromkeys([*named, token_id]))
            out.append(Logprobs(lp, ids, logprobs[row, ids].tolist(), r))
        return out
    if num_top <= 0:
        return [Logprobs(lp, rank=r) for lp, r in zip(chosen, ranks, strict=True)]
    top = torch.topk(logprobs, num_top, dim=-1)
    return [Logprobs(lp, ids, lps, r) for lp, ids, lps, r in zip(chosen, top.indices.tolist(), top.values.tolist(),
                                                               ranks, strict=True)]


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[Logprobs | None]]:
    """logits: [num_rows, vocab] float32 -> one token id per row, and its logprobs if asked."""
    wants_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = logits[wants_logprobs].log_softmax(-1) if wants_logprobs else None
    logits = apply_logits_processors(logits, rows)
    token_ids = logits.argmax(-1).tolist()
    for i, row in enumerate(rows):
        p = row.params
        if p.is_greedy:
            continue
        scaled = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = scaled.softmax(-1)
        gen = torch.Generator().manual_seed(draw_seed(row.seed, row.output_index))
        # exponential race: argmax(p / E) with E ~ Exp(1) draws from p
        noise = torch.empty_like(probs).exponential_(generator=gen)
        token_ids[i] = int((probs / noise).argmax())
    logprobs: list[Logprobs | None] = [None] * len(rows)
    for j, i in enumerate(wants_logprobs):
        p = rows[i].params
        logprobs[i] = logprobs_of(raw_logprobs[j : j + 1], [token_ids[i]], p.logprobs, p.logprob_token_ids)[0]
    return token_ids, logprobs
