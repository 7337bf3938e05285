"""An iteration's rows flattened into one ragged batch: what every paged backend's inputs start from."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.backends.base import BatchRow


@dataclass
class RaggedBatch:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # each new token's flat slot in the KV pool
    decodes: list[tuple[int, list[int], int]] = field(default_factory=list)  # (row, block table, context length)
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # (first row, queries, cached, table)


def flatten(batch: list[BatchRow], block_size: int) -> RaggedBatch:
    """A row of one new token decodes; a row of several is a prefill chunk after its computed tokens,
    unless its tokens past the first are speculative decoding's drafts: then each of its tokens is a
    decode query that sees the context up to itself (the decode kernels' arithmetic, as without drafts)."""
    out = RaggedBatch()
    for seq, num_new in batch:
        start = seq.num_computed_tokens
        row = len(out.input_ids)
        out.input_ids.extend(seq.input_ids(start, num_new))
        out.positions.extend(range(start, start + num_new))
        out.slots.extend(seq.block_table[p // block_size] * block_size + p % block_size
                         for p in range(start, start + num_new))
        table = seq.block_table[: (start + num_new + block_size - 1) // block_size]
        if num_new == 1 or seq.draft_ids:  # a row with drafts: each token a decode query of its own length
            out.decodes.extend((row + i, table, start + i + 1) for i in range(num_new))
        else:
            out.prefills.append((row, num_new, start, table))
    return out
