"""The QAIC program's layer ops: attention over the dense slot cache, in the program's fixed shapes;
norms, rotary and SwiGLU are the torch backend's."""

from __future__ import annotations

import torch

from services.worker.backends.qaic.inputs import SlotMeta
from services.worker.backends.qaic.kv_slots import SlotCache
from services.worker.backends.torch_cpu.ops import TorchOps


def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SlotMeta, scale: float,
                   window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [B, L, heads, d] over k/v [B, kv_heads, ctx_len, d], each query masked to the keys at or
    before its position (and, in a sliding-window layer, after position - window), its scores
    soft-capped where the layer says so; grouped matmuls
    (query heads by the KV head they share), softmax in float32. The shapes stay the program's."""
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads, ctx_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.to(k.dtype).permute(0, 2, 1, 3).reshape(batch, num_kv_heads, group * length, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, h_kv, group * L, ctx]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keys = torch.arange(ctx_len, device=k.device)
    visible = keys <= meta.query_positions[:, :, None]  # [B, L, ctx]
    if window is not None:
        visible = visible & (keys > meta.query_positions[:, :, None] - window)
    scores = scores.view(batch, num_kv_heads, group, length, ctx_len).masked_fill(~visible[:, None, None], float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(batch, num_kv_heads, group * length, ctx_len)
    out = torch.matmul(probs, v).view(batch, num_heads, length, head_dim)
    return out.transpose(1, 2).to(q.dtype)


class QaicOps(TorchOps):
    def attention(self, q, k, v, kv_cache: SlotCache, meta: SlotMeta, scale: float,
                  window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        batch, length = meta.write_positions.shape
        shape = (batch, length, *k.shape[1:])
        kv_cache.write(meta.slots, meta.write_positions, k.view(shape), v.view(shape))
        keys, values = kv_cache.read(meta.slots)
        out = slot_attention(q.view(batch, length, *q.shape[1:]), keys, values, meta, scale, window, softcap)
        return out.reshape(q.shape)


QAIC_OPS = QaicOps()
