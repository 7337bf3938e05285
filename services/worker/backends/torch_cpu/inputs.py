"""A batch of rows -> the torch backend's inputs: token ids, positions, slot mapping, block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.backends.base import BatchRow
from services.worker.backends.torch_cpu.attention import AttentionMetadata

MIN_DECODE_BLOCKS = 2  # compiled layers never see a one-block table (compiled.py)


@dataclass
class TorchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def build_inputs(batch: list[BatchRow], block_size: int, null_block: int) -> TorchInputs:
    bs = block_size
    input_ids, positions, slots = [], [], []
    decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
    for seq, num_new in batch:
        start = seq.num_computed_tokens
        row = len(input_ids)
        input_ids.extend(seq.token_ids[start : start + num_new])
        for pos in range(start, start + num_new):
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
        num_blocks = (start + num_new + bs - 1) // bs
        if num_new == 1:
            decode_rows.append(row)
            decode_tables.append(seq.block_table[:num_blocks])
            decode_lens.append(start + 1)
        else:
            prefills.append((row, num_new, start, torch.tensor(seq.block_table[:num_blocks])))
    # at least MIN_DECODE_BLOCKS wide; the padding points at the null block and is masked
    max_blocks = max((len(t) for t in decode_tables), default=0)
    max_blocks = max(max_blocks, MIN_DECODE_BLOCKS) if decode_tables else 0
    tables = torch.tensor([t + [null_block] * (max_blocks - len(t)) for t in decode_tables], dtype=torch.long)
    context_mask = (torch.arange(max_blocks * bs).unsqueeze(0) < torch.tensor(decode_lens).unsqueeze(1))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        decode_token_idx=torch.tensor(decode_rows, dtype=torch.long),
        decode_block_tables=tables.reshape(len(decode_tables), max_blocks),
        decode_context_mask=context_mask.reshape(len(decode_tables), 1, 1, max_blocks * bs),
        prefills=prefills,
    )
    return TorchInputs(torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta)
