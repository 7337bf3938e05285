"""A batch of rows -> the program's fixed shapes: a prefill chunk [1, prefill_seq_len] or a decode [slots, 1]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.backends.base import BatchRow


@dataclass
class SlotMeta:
    slots: torch.Tensor  # [B] the slot each row of the shape reads and writes
    write_positions: torch.Tensor  # [B, L] where each token's K/V goes; ctx_len (the drop column) for padding
    query_positions: torch.Tensor  # [B, L] each query sees keys at positions <= its own


@dataclass
class QaicInputs:
    input_ids: torch.Tensor  # [B * L]
    positions: torch.Tensor  # [B * L]
    meta: SlotMeta
    rows: torch.Tensor  # the batch's rows (ragged order) -> rows of the fixed shape
    specialization: str  # "prefill" | "decode"

    def to(self, device: torch.device) -> QaicInputs:
        """Built on the host; on a GPU, copied over at once."""
        if device.type == "cpu":
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        meta = SlotMeta(move(self.meta.slots), move(self.meta.write_positions), move(self.meta.query_positions))
        return QaicInputs(move(self.input_ids), move(self.positions), meta, move(self.rows), self.specialization)


def build_inputs(batch: list[BatchRow], num_slots: int, prefill_seq_len: int, ctx_len: int) -> QaicInputs:
    """Rows of one token each run in the decode shape (a one-token last chunk too: it is the same
    computation); a single row of several tokens runs in the prefill shape."""
    if len(batch) == 1 and batch[0][1] > 1:
        return _prefill(*batch[0], prefill_seq_len, ctx_len)
    if any(n != 1 for _, n in batch):
        raise ValueError("a static-shape step is one prefill chunk or one token per slot, not a mix "
                         f"(rows of {[n for _, n in batch]} tokens)")
    return _decode(batch, num_slots, ctx_len)


def _prefill(seq, num_new: int, chunk: int, ctx_len: int) -> QaicInputs:
    if num_new > chunk:
        raise ValueError(f"a prefill chunk of {num_new} tokens is longer than prefill_seq_len {chunk}")
    start = seq.num_computed_tokens
    ids = torch.zeros(chunk, dtype=torch.long)
    ids[:num_new] = torch.tensor(seq.token_ids[start : start + num_new])
    positions = torch.arange(start, start + chunk).clamp(max=ctx_len - 1)  # only padding is clamped
    writes = torch.where(torch.arange(chunk) < num_new, positions, ctx_len)
    meta = SlotMeta(torch.tensor([seq.block_table[0]]), writes.view(1, chunk), positions.view(1, chunk))
    return QaicInputs(ids, positions, meta, torch.arange(num_new), "prefill")


def _decode(batch: list[BatchRow], num_slots: int, ctx_len: int) -> QaicInputs:
    ids = torch.zeros(num_slots, dtype=torch.long)
    positions = torch.zeros(num_slots, dtype=torch.long)
    writes = torch.full((num_slots,), ctx_len, dtype=torch.long)
    rows = []
    for seq, _ in batch:
        slot, p = seq.block_table[0], seq.num_computed_tokens
        ids[slot], positions[slot], writes[slot] = seq.token_ids[p], p, p
        rows.append(slot)
    meta = SlotMeta(torch.arange(num_slots), writes.view(num_slots, 1), positions.view(num_slots, 1))
    return QaicInputs(ids, positions, meta, torch.tensor(rows, dtype=torch.long), "decode")
