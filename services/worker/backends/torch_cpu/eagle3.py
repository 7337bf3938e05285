"""An EAGLE-3 head on the torch CPU backend: the head, and its one layer's KV over the target's blocks."""

from __future__ import annotations

import torch

from services.worker.backends.kv_pool import KVSpec, null_block
from services.worker.backends.torch_cpu.dense import pack_linears
from services.worker.backends.torch_cpu.inputs import build_inputs
from services.worker.models.eagle3 import Eagle3Head


class Eagle3Drafter:
    def __init__(self, head: Eagle3Head, kv: KVSpec, num_blocks: int):
        self.head = pack_linears(head)
        self.config = head.config
        self.kv = kv
        self.block_size = kv.block_size
        self.kv_caches = kv.allocate(num_blocks)
        self.null_block = null_block(self.kv_caches)

    def forward(self, batch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a ragged batch (rows as the model's forward takes them) and each token's hidden
        input -> (the hidden states for the next position, the normed ones to draft from)."""
        inputs = build_inputs(batch, self.block_size, self.null_block)
        return self.head(inputs.input_ids, inputs.positions, hidden, self.kv_caches[0], inputs.meta)
