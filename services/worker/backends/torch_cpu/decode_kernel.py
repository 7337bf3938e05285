"""decode_attention.c, built at start-up (native.py) and called through ctypes.

The eager decode rows' attention reads each sequence's blocks in place instead of gathering them.
Where it cannot be built, `load` returns None and attention stays on torch's matmuls.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from services.worker.backends.torch_cpu import native

SOURCE = Path(__file__).with_name("decode_attention.c")
_ARGS = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float]
HEAD_DIMS = (64, 128)  # the head sizes it is built for


class DecodeKernel:
    """The built library's entry points (float32 and bfloat16, each head size) over torch tensors."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library
        self.entries = {(dtype, head_dim): getattr(library, f"decode_attention_{name}_{head_dim}")
                        for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")) for head_dim in HEAD_DIMS}
        for entry in self.entries.values():
            entry.argtypes, entry.restype = _ARGS, ctypes.c_int

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return q.dtype == k_cache.dtype and (q.dtype, q.shape[-1]) in self.entries

    def __call__(self, q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
        """q: [B, heads, d]; caches [blocks, kv heads, block size, d]; block_tables [B, max blocks] and
        context_lens [B] int64 -> [B, heads, d]."""
        q, block_tables, context_lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
        out = torch.empty_like(q)
        num_seqs, num_heads, head_dim = q.shape
        _, num_kv_heads, block_size, _ = k_cache.shape
        status = self.entries[q.dtype, head_dim](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
            out.data_ptr(), num_seqs, num_heads, num_kv_heads, block_size, block_tables.shape[1], scale)
        if status:
            raise RuntimeError(f"decode_attention failed ({status})")
        return out



def load(cache: Path | None = None) -> DecodeKernel | None:
    """The kernel, or None (logged) where it cannot be built here."""
    library = native.load(SOURCE, cache)
    return DecodeKernel(library) if library is not None else None
