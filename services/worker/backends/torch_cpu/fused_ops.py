"""fused_ops.c, built at start-up (native.py) and called through ctypes: the eager steps' row-wise ops.

The residual add with RMSNorm, rotary and silu(gate) * up, each one C pass over a row where torch
runs several ops (and as many Python dispatches). Where it cannot be built, `load` returns None.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from services.worker.backends.torch_cpu import native

SOURCE = Path(__file__).with_name("fused_ops.c")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {"add_rms_norm": [_P] * 5 + [_I, _I, _F], "rotary": [_P, _I, _P, _P, _P, _I, _I, _I],
              "silu_and_mul": [_P, _P, _I, _I]}
NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}


class FusedOps:
    """The built library's ops over torch tensors of float32 or bfloat16."""

    def __init__(self, library: ctypes.CDLL):
        self.entries = {}
        for op, argtypes in SIGNATURES.items():
            for dtype, name in NAMES.items():
                entry = getattr(library, f"{op}_{name}")
                entry.argtypes, entry.restype = argtypes, None
                self.entries[op, dtype] = entry

    def supports(self, *tensors: torch.Tensor) -> bool:
        dtype = tensors[0].dtype
        return dtype in NAMES and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)

    def add_rms_norm(self, x, residual, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rms_norm(x + residual), x + residual); x, residual: [..., dim]."""
        x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
        out, summed = torch.empty_like(x), torch.empty_like(x)
        dim = x.shape[-1]
        self.entries["add_rms_norm", x.dtype](x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                              summed.data_ptr(), x.numel() // dim, dim, eps)
        return out, summed

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, d], each row's heads contiguous; cos/sin: [T, d] float32 -> [T, heads, d]."""
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            x = x.contiguous()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        rows, heads, head_dim = x.shape
        self.entries["rotary", x.dtype](x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                                        rows, heads, head_dim)
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 * width] (gate, then up) -> [..., width]."""
        gate_up = gate_up.contiguous()
        width = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype)
        self.entries["silu_and_mul", gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * width),
                                                    width)
        return out


def load(cache: Path | None = None) -> FusedOps | None:
    """The ops, or None (logged) where they cannot be built here."""
    library = native.load(SOURCE, cache)
    return FusedOps(library) if library is not None else None
