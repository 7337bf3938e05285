"""The QAIC program's KV cache: dense per slot, `[num_slots, kv_heads, ctx_len + 1, head_dim]` a layer.

Writes scatter at (slot, position). Position ctx_len is the drop column: padded tokens (the tail
of a last prefill chunk, idle slots in a decode) write there and nothing reads it, which keeps
every write the same shape. With `mxint8_kv_cache` K and V are stored as MXINT8 (int8 elements,
one E8M0 scale per 32 along head_dim: 8.25 bits an element); the emulator keeps each written
position's decoded values beside them, so a read gathers values rather than decoding every slot's
whole context at every step (the same values: a code's decoding is exact in the compute dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.backends.qaic.mx import BLOCK, int8_decode, int8_encode
from services.worker.model_config import ModelConfig
from shared.config import ConfigError


@dataclass(frozen=True)
class SlotKVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    ctx_len: int
    dtype: torch.dtype  # what attention reads
    mxint8: bool

    @classmethod
    def of(cls, cfg: ModelConfig, ctx_len: int, dtype: torch.dtype, mxint8: bool) -> SlotKVSpec:
        if mxint8 and cfg.head_dim % BLOCK:
            raise ConfigError(f"mxint8_kv_cache needs head_dim to be a multiple of {BLOCK}, got {cfg.head_dim}")
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, ctx_len, dtype, mxint8)

    @property
    def block_size(self) -> int:
        return self.ctx_len  # a slot: one block of ctx_len tokens (what the hello announces)

    def check_capacity(self, num_slots: int, max_model_len: int) -> None:
        if max_model_len > self.ctx_len:
            raise ConfigError(f"max_model_len {max_model_len} is longer than the program's ctx_len {self.ctx_len}")

    def allocate(self, num_slots: int, device: torch.device | str = "cpu") -> list[SlotCache]:
        return [SlotCache(self, num_slots, device) for _ in range(self.num_layers)]


class SlotCache:
    """One layer's K and V."""

    def __init__(self, spec: SlotKVSpec, num_slots: int, device: torch.device | str = "cpu"):
        self.spec = spec
        shape = (num_slots, spec.num_kv_heads, spec.ctx_len + 1, spec.head_dim)
        self.every_slot = torch.arange(num_slots, device=device)  # a decode's slots: read in place

        def zeros(size, dtype):
            return torch.zeros(size, dtype=dtype, device=device)

        if spec.mxint8:
            scales = (*shape[:-1], spec.head_dim // BLOCK)
            self.k, self.v = zeros(shape, torch.int8), zeros(shape, torch.int8)
            self.k_scales, self.v_scales = zeros(scales, torch.uint8), zeros(scales, torch.uint8)
            self.k_values, self.v_values = zeros(shape, spec.dtype), zeros(shape, spec.dtype)  # the emulator's
        else:
            self.k, self.v = zeros(shape, spec.dtype), zeros(shape, spec.dtype)

    @property
    def nbytes(self) -> int:
        """What the device stores (the emulator's decoded values are the host's)."""
        tensors = [self.k, self.v] + ([self.k_scales, self.v_scales] if self.spec.mxint8 else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [B], positions [B, L] (ctx_len: dropped), k/v [B, L, kv_heads, head_dim]."""
        at = (slots[:, None], slice(None), positions)
        if self.spec.mxint8:
            (kq, ks), (vq, vs) = int8_encode(k), int8_encode(v)
            self.k[at], self.k_scales[at], self.v[at], self.v_scales[at] = kq, ks, vq, vs
            self.k_values[at] = int8_decode(kq, ks, self.spec.dtype)
            self.v_values[at] = int8_decode(vq, vs, self.spec.dtype)
        else:
            self.k[at], self.v[at] = k.to(self.k.dtype), v.to(self.v.dtype)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> K, V of the slots, [B, kv_heads, ctx_len, head_dim] in the compute dtype."""
        n = self.spec.ctx_len
        k, v = (self.k_values, self.v_values) if self.spec.mxint8 else (self.k, self.v)
        if torch.equal(slots, self.every_slot):
            return k[:, :, :n], v[:, :, :n]  # a decode: every slot in order
        return k[slots, :, :n], v[slots, :, :n]
