"""Sampling on the GPU: one host sync (the sampled ids) per step.

Rows that need no logits processor and no logprobs are drawn on the device: temperature, top-k,
top-p and min-p as batched tensor ops, and the random draw from a counter-based hash of (request
seed, output index, token id), so a seeded request draws the same tokens whatever else is in the
batch, with no generator per row. Rows with processors (logit_bias, penalties, min_tokens bans, a
grammar) or logprobs go to the CPU sampler, which is the reference and keeps its own per-request
generator; which path a row takes depends on that request alone.
"""

from __future__ import annotations

import torch

from services.worker.backends.cuda.inputs import to_device
from services.worker.logits_processors import SampleRow
from services.worker.sampler import sample as cpu_sample
from shared.wire.messages import Logprobs

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 (torch's >> keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform_noise(seeds: torch.Tensor, output_indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] uniform in (0, 1), a function of (seed, output index, token id) alone (splitmix64)."""
    token_ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _GOLDEN + output_indices[:, None] * _MIX1 + token_ids[None, :] * _MIX2
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 11).to(torch.float64) + 0.5).mul_(2.0**-53).to(torch.float32)


def is_plain(row: SampleRow) -> bool:
    p = row.params
    return (not p.logit_bias and not p.has_penalties and not row.banned_ids and row.allowed is None
            and p.logprobs is None and not p.allowed_token_ids)


def device_sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """logits [n, vocab] float32 on the device -> [n] int64 ids on the device."""
    greedy_ids = logits.argmax(-1)
    if all(r.params.is_greedy for r in rows):
        return greedy_ids
    dev = logits.device
    params = [r.params for r in rows]

    def per_row(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), dev)  # pinned, so no wait for the forward

    temperature = per_row([p.temperature if not p.is_greedy else 1.0 for p in params])
    scaled = logits / temperature[:, None]
    sorted_logits, order = scaled.sort(-1, descending=True)
    vocab = logits.shape[1]
    top_k = per_row([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64)
    ranks = torch.arange(vocab, device=dev)[None, :]
    cut = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(-1)
    min_p = per_row([p.min_p for p in params])
    cut |= probs < min_p[:, None] * probs[:, :1]
    top_p = per_row([p.top_p for p in params])
    cut |= (probs.cumsum(-1) - probs) >= top_p[:, None]  # the top token always stays
    kept = sorted_logits.masked_fill(cut, float("-inf")).softmax(-1)
    probs = torch.zeros_like(kept).scatter_(1, order, kept)
    seeds = per_row([r.seed for r in rows], torch.int64)
    indices = per_row([r.output_index for r in rows], torch.int64)
    exponential = -uniform_noise(seeds, indices, vocab).log()
    drawn = (probs / exponential).argmax(-1)  # exponential race: argmax(p / E) draws from p
    is_greedy = per_row([p.is_greedy for p in params], torch.bool)
    return torch.where(is_greedy, greedy_ids, drawn)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[Logprobs | None]]:
    token_ids: list[int] = [0] * len(rows)
    logprobs: list[Logprobs | None] = [None] * len(rows)
    plain = [i for i, r in enumerate(rows) if is_plain(r)]
    other = [i for i in range(len(rows)) if i not in set(plain)]
    if other:
        ids, lps = cpu_sample(logits[other].cpu(), [rows[i] for i in other])
        for i, token_id, lp in zip(other, ids, lps, strict=True):
            token_ids[i], logprobs[i] = token_id, lp
    if plain:
        ids = device_sample(logits[plain] if len(plain) < len(rows) else logits, [rows[i] for i in plain]).tolist()
        for i, token_id in zip(plain, ids, strict=True):
            token_ids[i] = token_id
    return token_ids, logprobs
