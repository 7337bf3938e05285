"""A GGUF's embedding table kept in its blocks, each step's rows dequantized (every backend's)."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.loader.quant_blocks import SUPER, QuantBlocks


class QuantEmbedding(nn.Module):
    """An embedding table kept in the file's blocks (4-bit values two to a byte; 5- and 6-bit ones so,
    with a plane of bytes for each bit past the fourth): the rows a step looks up are dequantized as
    gguf dequantizes them, into the model's dtype. Torch's ops alone: the CPU's and the CUDA backend's."""

    def __init__(self, blocks: QuantBlocks, dtype: torch.dtype):
        super().__init__()
        q = blocks.q
        if blocks.bits == 6:  # -32..31 as 0..63
            q = (q.to(torch.int16) + 32).to(torch.uint8)
        self.bits, self.group, self.dtype = blocks.bits, blocks.group, dtype
        self.num_embeddings, self.embedding_dim = blocks.q.shape
        planes = None  # [bits - 4, rows, dim / 8]: bit j of byte b is input 8b + j's bit 4 (5, ...)
        if blocks.bits in (5, 6):
            bits = torch.stack([(q >> b) & 1 for b in range(4, blocks.bits)]).view(blocks.bits - 4, q.shape[0], -1, 8)
            planes = (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
        if blocks.bits in (4, 5, 6):
            q = (q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)
        self.register_buffer("q", q.contiguous())
        self.register_buffer("planes", planes)
        self.register_buffer("scales", blocks.scale.to(blocks.scale_dtype))
        self.register_buffer("lows", None if blocks.low is None else blocks.low.to(blocks.scale_dtype))
        self.register_buffer("supers", None if blocks.supers is None else blocks.supers.half())
        self.register_buffer("codebook", blocks.codebook)
        self.register_buffer("shifts", torch.arange(8, dtype=torch.uint8), persistent=False)  # on the table's device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.q[ids]
        if self.bits in (4, 5, 6):
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).flatten(-2)
        if self.codebook is not None:
            q = self.codebook[q.long()]
        for b in range(4, self.bits if self.bits in (5, 6) else 4):
            q = q | ((((self.planes[b - 4][ids][..., None] >> self.shifts) & 1) << b).flatten(-2))
        if self.bits == 6:
            q = q.to(torch.int16) - 32
        q = q.reshape(*ids.shape, self.embedding_dim // self.group, self.group).float()
        scale, low = self.scales[ids].float(), None if self.lows is None else self.lows[ids].float()
        if self.supers is not None:  # two levels: each group's int8 times its super-block's float16
            supers = self.supers[ids].float().repeat_interleave(SUPER // self.group, dim=-2)
            scale, low = scale * supers[..., 0], None if low is None else low * supers[..., 1]
        scale = scale[..., None]
        rows = q * scale if low is None else torch.addcmul(low[..., None], q, scale)
        return rows.reshape(*ids.shape, self.embedding_dim).to(self.dtype)
