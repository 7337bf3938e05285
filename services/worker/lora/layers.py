"""The base model's Linears with LoRA slots beside them: y = base(x) + B[s] A[s] x for each token whose
row runs on the adapter in slot s (one grouped op per Linear for the whole mixed batch; base rows
untouched), and which slot each token of a step uses."""

from __future__ import annotations

import functools

import torch
from torch import nn

PADDED_MAX_TOKENS = 64  # past this, a step's adapters go one matmul pair each (mostly prefill chunks)


class LoraRows:
    """One step's tokens by adapter slot. `token_slots` [T] is each token's slot, -1 for the base
    model: what the C and Triton kernels read. The torch reference's groupings are made only when
    it asks for them (the fast paths never do)."""

    def __init__(self, slots_per_row: list[int], tokens_per_row: list[int], device: torch.device):
        self.slots_per_row, self.device = slots_per_row, device
        self.starts = [0]
        for n in tokens_per_row:
            self.starts.append(self.starts[-1] + n)
        self.token_slots = torch.repeat_interleave(torch.tensor(slots_per_row), torch.tensor(tokens_per_row)).to(device)

    @classmethod
    def of(cls, slots_per_row: list[int], tokens_per_row: list[int], device: torch.device) -> LoraRows | None:
        """None when no row uses an adapter (the step runs the base model alone, graphs and all)."""
        if all(s < 0 for s in slots_per_row):
            return None
        return cls(slots_per_row, tokens_per_row, device)

    @functools.cached_property
    def groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        """For each slot the step uses, its tokens: a slice (one sequence's run) or an index tensor."""
        starts, groups = self.starts, []
        for slot in sorted({s for s in self.slots_per_row if s >= 0}):
            rows = [i for i, s in enumerate(self.slots_per_row) if s == slot]
            if len(rows) == 1:
                groups.append((slot, slice(starts[rows[0]], starts[rows[0] + 1])))
            else:
                index = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows])
                groups.append((slot, index.to(self.device)))
        return groups

    @functools.cached_property
    def padded(self) -> torch.Tensor | None:
        """A decode-sized step (<= PADDED_MAX_TOKENS tokens): each slot 0..S-1's tokens as one row of
        indices [S, n], padded with T (a zero row), so every adapter's tokens go in one batched matmul."""
        starts = self.starts
        if starts[-1] > PADDED_MAX_TOKENS:
            return None
        tokens = [[] for _ in range(max(self.slots_per_row) + 1)]
        for row, slot in enumerate(self.slots_per_row):
            if slot >= 0:
                tokens[slot].extend(range(starts[row], starts[row + 1]))
        width = max(len(t) for t in tokens)
        return torch.tensor([t + [starts[-1]] * (width - len(t)) for t in tokens]).to(self.device)


class LoraState:
    """Shared by a model's LoRA Linears: the step's rows (set by the runner; None: no adapter)."""

    def __init__(self) -> None:
        self.rows: LoraRows | None = None


class LoraLinear(nn.Module):
    """A base Linear (of any kind: dense, packed, quantized) whose output is `len(out_sizes)` slices
    side by side (q|k|v, gate|up, or one), each slice with its own LoRA A and B per slot.

    a: [slots, n * R, in] (slice i's A in rows i*R..); b: [slots, out, n * R], block-diagonal
    (slice i's B, scaled, in its output rows and columns i*R..), zero where an adapter's rank is
    under R or it leaves a slice out. One shrink and one expand then cover every slice."""

    def __init__(self, base: nn.Module, fan_in: int, out_sizes: list[int], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, state: LoraState, ops):
        super().__init__()
        self.base, self.state, self.ops = base, state, ops
        self.max_rank, self.out_sizes = max_rank, out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        width = len(out_sizes) * max_rank
        self.register_buffer("a", torch.zeros(num_slots, width, fan_in, dtype=dtype, device=device), persistent=False)
        self.register_buffer("b", torch.zeros(num_slots, sum(out_sizes), width, dtype=dtype, device=device),
                             persistent=False)

    def set_slot(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor, float] | None]) -> None:
        """Slot `slot` takes an adapter: one (A [r, in], B [out_i, r], scaling) per slice, or None."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, piece in enumerate(pieces):
            if piece is None:
                continue
            a, b, scaling = piece
            cols = slice(i * self.max_rank, i * self.max_rank + a.shape[0])
            self.a[slot, cols] = a.to(self.a.dtype)
            self.b[slot, self.offsets[i] : self.offsets[i] + self.out_sizes[i], cols] = (b * scaling).to(self.b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.state.rows
        if rows is None:
            return y
        return self.ops.lora_add(x, y, self.a, self.b, rows, self.out_sizes)
