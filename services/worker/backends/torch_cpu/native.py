"""The C kernels' build: a source compiled with the machine's C compiler into the cache, loaded with ctypes.

Built once per source, flags and CPU (a fraction of a second); where there is no compiler (the
slim image) or the build fails, `load` returns None and the caller keeps torch's ops. OpenMP is
torch's own runtime (same soname, already loaded), so the kernels share torch's threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from shared.log import get_logger
from shared.model_files import cache_root

log = get_logger("worker.native")
HERE = Path(__file__).parent
HEADERS = [HERE / "cpu_math.h", HERE / "decode_attention_avx512.h"]  # what the sources include
# fast-math lets the compiler reorder the dot products' sums into vector lanes; each row's
# arithmetic is still fixed whatever the batch. Infinities stay: the softmax starts from -inf.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cpu_id() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def build(source: Path, cache: Path | None = None) -> Path:
    """The shared library for this source, flags and CPU: from the cache, else compiled into it."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc) on PATH")
    text = b"".join(path.read_bytes() for path in (source, *HEADERS))
    key = hashlib.sha256(text + " ".join(FLAGS).encode() + _cpu_id().encode()).hexdigest()[:16]
    target = (cache or cache_root() / "kernels") / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed in: never half a file
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, str(source), "-o", str(built), "-lm"], check=True,
                           capture_output=True, text=True, timeout=120)
            built.replace(target)
    return target


def load(source: Path, cache: Path | None = None) -> ctypes.CDLL | None:
    """The built library, or None (logged) where it cannot be built here."""
    try:
        return ctypes.CDLL(str(build(source, cache)))
    except (OSError, subprocess.SubprocessError, FileNotFoundError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("native_kernel_unavailable", source=source.name, reason=detail.strip()[-400:])
        return None
