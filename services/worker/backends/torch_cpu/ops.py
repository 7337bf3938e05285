"""The torch backend's layer ops: plain torch, the reference every other backend's ops match."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.backends.torch_cpu.attention import AttentionMetadata, paged_attention, write_kv
from services.worker.backends.torch_cpu.decode_kernel import DecodeKernel
from services.worker.backends.torch_cpu.fused_ops import FusedOps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; cos/sin: [T, d] (half-split layout, as Hugging Face's)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos.unsqueeze(1) + rotated.float() * sin.unsqueeze(1)).to(x.dtype)


class TorchOps:
    """Torch's ops; outside --deterministic, the eager steps' decode attention and row-wise ops in C
    (decode_kernel.py, fused_ops.py). Compiled code always traces the torch ops."""

    def __init__(self, decode_kernel: DecodeKernel | None = None, fused: FusedOps | None = None):
        self.decode_kernel = decode_kernel
        self.fused = fused

    def _fused_for(self, *tensors: torch.Tensor) -> FusedOps | None:
        if self.fused is None or torch.compiler.is_dynamo_compiling() or not self.fused.supports(*tensors):
            return None
        return self.fused

    def attention(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale, self.decode_kernel)

    def add_rms_norm(self, x, residual, weight, eps):
        if fused := self._fused_for(x, residual, weight):
            return fused.add_rms_norm(x, residual, weight, eps)
        summed = residual + x
        return rms_norm(summed, weight, eps), summed

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def rotary(self, q, k, cos, sin):
        if fused := self._fused_for(q, k):
            return fused.rotate(q, cos, sin), fused.rotate(k, cos, sin)
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def silu_and_mul(self, gate_up):
        if fused := self._fused_for(gate_up):
            return fused.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


TORCH_OPS = TorchOps()  # the reference: torch alone
