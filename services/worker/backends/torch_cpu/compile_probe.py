"""A tiny compile before --compile's real one, in a process of its own: whether Inductor's C++ build
works on this CPU, known in seconds and cached per CPU, torch and compiler."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from shared.cpu_features import host_cpu_flags

# what compiled.py compiles with: the graph's wrapper in C++ too, one compile job (the serving
# thread keeps the other cores)
COMPILE_OPTIONS = {"cpp_wrapper": True, "compile_threads": 1}
PROBE_TIMEOUT_S = 180


def _compiler() -> str:
    path = shutil.which(os.environ.get("CXX", "g++"))
    if path is None:
        return "none"
    return subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def probe(cache: Path) -> str | None:
    """None where a compile works on this host, else why not. A failure is kept in `cache`, so the
    next start knows at once; a timeout is not (the host may only have been busy)."""
    compiler = _compiler()
    key = hashlib.sha256(" ".join([*sorted(host_cpu_flags()), torch.__version__, compiler]).encode()).hexdigest()[:16]
    path = cache / f"{key}.json"
    try:
        return json.loads(path.read_text())["failure"]
    except (OSError, ValueError, KeyError):
        pass
    if compiler == "none":
        failure = "no C++ compiler (g++) for torch.compile's Inductor"
    else:
        with tempfile.TemporaryDirectory() as inductor_cache:  # a cold cache: the probe must really compile
            env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": inductor_cache}
            try:
                done = subprocess.run([sys.executable, "-m", __name__], env=env, capture_output=True, text=True,
                                      timeout=PROBE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return f"the probe compile took over {PROBE_TIMEOUT_S} s"
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        failure = None if done.returncode == 0 else f"the probe compile failed: {lines[-1] if lines else done.returncode}"
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"failure": failure, "torch": torch.__version__, "compiler": compiler}))
    return failure


def _graph(x, residual, norm, qweight, scales, lows, k_cache, slots):
    """A layer's kinds of work: the C kernels' ops, a write through a slot mapping, torch's own ops."""
    h, residual = torch.ops.switchyard_cpu.add_rms_norm(x, residual, norm, 1e-5)
    h = torch.ops.switchyard_cpu.quant_linear(h, qweight, scales, lows, 4, None)
    k_cache[slots] = h[:, :32].to(k_cache.dtype)
    return torch.ops.switchyard_cpu.silu_and_mul(h) * 2 + residual[:, :16], residual


def main() -> None:
    from services.worker.backends.torch_cpu.kernels.load import load

    kernels = load()
    if not kernels.loaded:
        sys.exit(kernels.reason)
    torch.manual_seed(0)
    args = dict(norm=torch.ones(64), qweight=torch.randint(0, 255, (2, 32, 16), dtype=torch.uint8),
                scales=torch.full((2, 2, 16), 0.01).half(), lows=torch.zeros(2, 2, 16).half(),
                k_cache=torch.zeros(16, 32))
    compiled = torch.compile(_graph, dynamic=True, options=COMPILE_OPTIONS)
    for rows in (1, 3):
        x, residual, slots = torch.randn(rows, 64), torch.randn(rows, 64), torch.arange(rows)
        got, expected = compiled(x, residual, slots=slots, **args), _graph(x, residual, slots=slots, **args)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b)


if __name__ == "__main__":
    main()
