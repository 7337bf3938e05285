"""Sampling on the worker: greedy, temperature, top-k, top-p, and a seed per request.

Random draws come from a generator seeded with (request seed, output index), so a request's
tokens do not depend on what else is in the batch, nor on being preempted and recomputed.
"""

from __future__ import annotations

import torch

from shared.messages import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive indices apart


def draw_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 + output_index * _MIX) & 0x7FFF_FFFF_FFFF_FFFF


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [vocab] already temperature-scaled; returns logits with cut tokens at -inf."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           output_indices: list[int], banned_ids: list[list[int]]) -> list[int]:
    """logits: [num_seqs, vocab] float32 -> one token id per row."""
    for row, banned in enumerate(banned_ids):
        if banned:
            logits[row, banned] = float("-inf")
    token_ids = logits.argmax(-1).tolist()
    for row, p in enumerate(params):
        if p.is_greedy:
            continue
        scaled = apply_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = scaled.softmax(-1)
        gen = torch.Generator().manual_seed(draw_seed(seeds[row], output_indices[row]))
        # exponential race: argmax(p / E) with E ~ Exp(1) draws from p
        noise = torch.empty_like(probs).exponential_(generator=gen)
        token_ids[row] = int((probs / noise).argmax())
    return token_ids
