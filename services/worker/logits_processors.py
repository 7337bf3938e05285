"""What changes the logits before a token is drawn: logit_bias, penalties, bans, grammar masks.

Each processor touches only the rows that asked for it, so a plain request pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.wire.messages import SamplingParams


@dataclass
class SampleRow:
    """One sequence about to draw a token: what its processors and its draw need."""

    params: SamplingParams
    seed: int
    output_index: int
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    banned_ids: list[int] = field(default_factory=list)
    allowed: torch.Tensor | None = None  # bool [vocab] from the grammar; None = every token


def apply_logits_processors(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """logits: [num_rows, vocab] float32, modified in place and returned."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype))
        if p.has_penalties:
            _apply_penalties(logits[i], p, row.prompt_ids, row.output_ids, vocab)
        if row.banned_ids:
            logits[i, row.banned_ids] = float("-inf")
        if p.allowed_token_ids:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.long)] = True
            logits[i].masked_fill_(~keep.to(logits.device), float("-inf"))
        if row.allowed is not None:
            logits[i].masked_fill_(~row.allowed, float("-inf"))
    return logits


def _apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                     vocab: int) -> None:
    """OpenAI's presence/frequency penalties over the output; vLLM's repetition penalty over both."""
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab]
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_ids:
            seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    if p.frequency_penalty:
        logits -= p.frequency_penalty * counts.to(logits.dtype)
    if p.presence_penalty:
        logits -= p.presence_penalty * (counts > 0).to(logits.dtype)
