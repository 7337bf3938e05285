"""The torch backend's layer ops: torch's own (the reference every other backend's ops match), or the C
kernels' where they take the tensors (the fast path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.backends.torch_cpu.attention import (
    NATIVE_DTYPES,
    AttentionMetadata,
    paged_attention,
    write_kv,
)
from services.worker.backends.torch_cpu.experts import grouped_experts
from services.worker.backends.torch_cpu.lora import lora_add


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; cos/sin: [T, r] (half-split layout, as Hugging Face's): a partial rotary
    (r < d) rotates each head's first r values and passes the rest, as transformers does."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat([rotate(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos.unsqueeze(1) + rotated.float() * sin.unsqueeze(1)).to(x.dtype)


class TorchOps:
    """Torch's ops; with `native`, the C kernels' ops (kernels/, `torch.ops.switchyard_cpu`) wherever
    they take the tensors, eagerly and in compiled code alike, so both compute the same numbers."""

    def __init__(self, native: bool = False):
        self.native = native

    def _is_native(self, x: torch.Tensor) -> bool:
        return self.native and x.dtype in NATIVE_DTYPES

    def attention(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                  window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if self.native and k.dtype == k_cache.dtype and not torch.compiler.is_dynamo_compiling():
            # one op for torch's six; a compiled graph makes its own scatter of write_kv's (is_compiling()
            # is process-wide: True here too while another thread compiles)
            torch.ops.switchyard_cpu.write_kv_(k_cache, v_cache, k, v, meta.slot_mapping)
        else:
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale, native=self._is_native(q), window=window,
                               softcap=softcap)

    def add_rms_norm(self, x, residual, weight, eps):
        if self._is_native(x):
            return torch.ops.switchyard_cpu.add_rms_norm(x, residual, weight, eps)
        summed = residual + x
        return rms_norm(summed, weight, eps), summed

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def rotary(self, q, k, cos, sin):
        if self._is_native(q) and cos.shape[-1] == q.shape[-1]:  # the C kernel rotates whole heads
            return torch.ops.switchyard_cpu.rotary(q, cos, sin), torch.ops.switchyard_cpu.rotary(k, cos, sin)
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def silu_and_mul(self, gate_up):
        if self._is_native(gate_up):
            return torch.ops.switchyard_cpu.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def routed_experts(self, x, w13, w2, weights, experts):
        return grouped_experts(x, w13, w2, weights, experts)

    def lora_add(self, x, y, a, b, rows, out_sizes):
        if self._is_native(x) and y.is_contiguous() and x.dtype == y.dtype == a.dtype:
            torch.ops.switchyard_cpu.lora_add_(y, x.contiguous(), a, b, rows.token_slots, out_sizes)
            return y
        return lora_add(x, y, a, b, rows)


TORCH_OPS = TorchOps()  # the reference: torch alone
NATIVE_OPS = TorchOps(native=True)  # the C kernels where they apply (a worker uses it once they are loaded)
