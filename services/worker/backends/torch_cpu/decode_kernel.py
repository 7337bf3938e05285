"""decode_attention.c, built with the machine's C compiler at start-up and called through ctypes.

The eager decode rows' attention reads each sequence's blocks in place instead of gathering them.
Built once per source and CPU into the cache (a fraction of a second); where there is no compiler
(the slim image) or the build fails, `load` returns None and attention stays on torch's matmuls.
Its OpenMP is torch's own runtime (same soname, already loaded), so it shares torch's threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from shared.log import get_logger
from shared.model_files import cache_root

log = get_logger("worker.decode_kernel")
SOURCE = Path(__file__).with_name("decode_attention.c")
HEADERS = [Path(__file__).with_name("decode_attention_avx512.h")]  # included by SOURCE
# fast-math lets the compiler reorder the dot products' sums into vector lanes; each sequence's
# arithmetic is still fixed whatever the batch. Infinities stay: the softmax starts from -inf.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
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


def _cpu_id() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def build(cache: Path | None = None) -> Path:
    """The shared library for this source, flags and CPU: from the cache, else compiled into it."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc) on PATH")
    key = hashlib.sha256(b"".join(path.read_bytes() for path in (SOURCE, *HEADERS)) + " ".join(FLAGS).encode() + _cpu_id().encode()).hexdigest()[:16]
    target = (cache or cache_root() / "kernels") / f"decode_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed in: never half a file
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True,
                           capture_output=True, text=True, timeout=120)
            built.replace(target)
    return target


def load(cache: Path | None = None) -> DecodeKernel | None:
    """The kernel, or None (logged) where it cannot be built here."""
    try:
        return DecodeKernel(ctypes.CDLL(str(build(cache))))
    except (OSError, subprocess.SubprocessError, FileNotFoundError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("decode_kernel_unavailable", reason=detail.strip()[-400:])
        return None
