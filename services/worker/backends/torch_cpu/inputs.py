"""A batch of rows -> the torch backend's inputs: token ids, positions, slot mapping, block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.backends.base import BatchRow
from services.worker.backends.ragged import flatten
from services.worker.backends.torch_cpu.attention import AttentionMetadata

MIN_DECODE_BLOCKS = 2  # compiled layers never see a one-block table (compiled.py)


@dataclass
class TorchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, features): an image-text model's


def build_inputs(batch: list[BatchRow], block_size: int, null_block: int) -> TorchInputs:
    ragged = flatten(batch, block_size)
    decode_tables = [table for _, table, _ in ragged.decodes]
    # at least MIN_DECODE_BLOCKS wide; the padding points at the null block and is masked
    max_blocks = max((len(t) for t in decode_tables), default=0)
    max_blocks = max(max_blocks, MIN_DECODE_BLOCKS) if decode_tables else 0
    tables = torch.tensor([t + [null_block] * (max_blocks - len(t)) for t in decode_tables], dtype=torch.long)
    decode_lens = torch.tensor([length for _, _, length in ragged.decodes])
    context_mask = torch.arange(max_blocks * block_size).unsqueeze(0) < decode_lens.unsqueeze(1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(ragged.slots, dtype=torch.long),
        decode_token_idx=torch.tensor([row for row, _, _ in ragged.decodes], dtype=torch.long),
        decode_block_tables=tables.reshape(len(decode_tables), max_blocks),
        decode_context_mask=context_mask.reshape(len(decode_tables), 1, 1, max_blocks * block_size),
        decode_context_lens=decode_lens.to(torch.long),
        prefills=[(row, n, cached, torch.tensor(table)) for row, n, cached, table in ragged.prefills],
        decode_max_context=max((length for _, _, length in ragged.decodes), default=0),
    )
    return TorchInputs(torch.tensor(ragged.input_ids, dtype=torch.long),
                       torch.tensor(ragged.positions, dtype=torch.long), meta)
