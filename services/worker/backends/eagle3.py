"""An EAGLE-3 head beside a paged backend's model: the head, and its one layer's KV over the same
blocks (a block id the scheduler hands out addresses both), its inputs built as the target's are."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.backends.kv_pool import KVSpec
from services.worker.models.eagle3 import Eagle3Head


class Eagle3Drafter:
    def __init__(self, head: Eagle3Head, kv: KVSpec, num_blocks: int, prepare: Callable,
                 device: torch.device | str = "cpu"):
        """prepare: the target backend's (rows -> its forward's inputs); the head's pool has as many
        blocks, so the same null block."""
        self.head = head
        self.config = head.config
        self.kv = kv
        self.kv_caches = kv.allocate(num_blocks, device)
        self.prepare = prepare

    def forward(self, batch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a ragged batch (rows as the model's forward takes them) and each token's hidden
        input -> (the hidden states for the next position, the normed ones to draft from)."""
        inputs = self.prepare(batch)
        return self.head(inputs.input_ids, inputs.positions, hidden, self.kv_caches[0], inputs.meta)
