"""A batch of rows -> the CUDA backend's inputs: built on the host, copied to the device at once.

Decode rows and prefill chunks keep their places in the ragged batch; each attention kernel reads
its rows through an index (decode) or a start (prefill), so nothing is gathered or reordered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.backends.base import BatchRow
from services.worker.backends.cuda.kernels.decode_attention import num_splits_for
from services.worker.backends.ragged import flatten


@dataclass
class CudaMeta:
    slot_mapping: torch.Tensor  # [T] int64, -1: a padding row (nothing written)
    decode_rows: torch.Tensor  # [B] int32 rows of the batch that decode
    decode_tables: torch.Tensor  # [B, width] int32, padded with the null block
    decode_lens: torch.Tensor  # [B] int32 context length (the new token included)
    num_splits: int
    prefill_starts: torch.Tensor  # [C] int32 first row of each prefill chunk
    prefill_lens: torch.Tensor  # [C] int32 its number of queries
    prefill_cached: torch.Tensor  # [C] int32 tokens before them in the cache
    prefill_tables: torch.Tensor  # [C, width] int32
    max_query_len: int
    max_decode_len: int  # the longest decode context (graphs capture up to max_seq_len_to_capture)
    # [T] int32: the last key position each prefill row also sees (Gemma 3's image tokens, both
    # ways); None: every row causal
    prefill_limits: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.prefill_starts.shape[0] == 0


@dataclass
class CudaInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor  # [T]; [3, T] for M-RoPE's image tokens (mrope.py)
    meta: CudaMeta
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, features): an image-text model's


def _table(rows: list[list[int]], width: int, null_block: int) -> torch.Tensor:
    return torch.tensor([r + [null_block] * (width - len(r)) for r in rows], dtype=torch.int32).view(len(rows), width)


def build_inputs(batch: list[BatchRow], block_size: int, null_block: int, device: torch.device,
                 num_kv_heads: int, num_sms: int) -> CudaInputs:
    ragged = flatten(batch, block_size)
    decode_tables = [table for _, table, _ in ragged.decodes]
    prefill_tables = [table for *_, table in ragged.prefills]
    decode_lens = [length for _, _, length in ragged.decodes]
    host = dict(
        slot_mapping=torch.tensor(ragged.slots, dtype=torch.int64),
        decode_rows=torch.tensor([row for row, _, _ in ragged.decodes], dtype=torch.int32),
        decode_tables=_table(decode_tables, max((len(t) for t in decode_tables), default=0), null_block),
        decode_lens=torch.tensor(decode_lens, dtype=torch.int32),
        prefill_starts=torch.tensor([row for row, *_ in ragged.prefills], dtype=torch.int32),
        prefill_lens=torch.tensor([n for _, n, _, _ in ragged.prefills], dtype=torch.int32),
        prefill_cached=torch.tensor([cached for _, _, cached, _ in ragged.prefills], dtype=torch.int32),
        prefill_tables=_table(prefill_tables, max((len(t) for t in prefill_tables), default=0), null_block),
    )
    moved = {name: to_device(t, device) for name, t in host.items()}
    max_decode_len = max(decode_lens, default=0)
    meta = CudaMeta(**moved, num_splits=num_splits_for(max_decode_len, block_size, len(decode_lens), num_kv_heads,
                                                       num_sms),
                    max_query_len=max((n for _, n, _, _ in ragged.prefills), default=0), max_decode_len=max_decode_len)
    return CudaInputs(to_device(torch.tensor(ragged.input_ids, dtype=torch.int64), device),
                      to_device(torch.tensor(ragged.positions, dtype=torch.int64), device), meta)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without waiting: from pinned memory the copy is asynchronous to the host."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def span_limits(batch: list[BatchRow], spans: dict[int, list[tuple[int, int]]], device: torch.device
                ) -> torch.Tensor | None:
    """The rows' limits for prefill_attention from the image spans of each prefill (keyed by its
    first row, as services/worker/images.py gives them): an image's rows see up to its last token."""
    if not spans:
        return None
    limits = torch.full((sum(n for _, n in batch),), -1, dtype=torch.int32)
    row = 0
    for seq, num_new in batch:
        for begin, end in spans.get(row, ()):
            limits[row + begin - seq.num_computed_tokens:row + end - seq.num_computed_tokens] = end - 1
        row += num_new
    return to_device(limits, device)
