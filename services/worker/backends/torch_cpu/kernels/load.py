"""The CPU kernels' library (build.py) loaded into torch as `torch.ops.switchyard_cpu.*`, or the reason
it is not: a worker never builds it, and without it serves on torch's own ops."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.backends.torch_cpu.kernels import build


@dataclass(frozen=True)
class Kernels:
    variant: str | None  # the instruction set they run on here; None: not loaded
    reason: str  # what was loaded, or why nothing was

    @property
    def loaded(self) -> bool:
        return self.variant is not None


@functools.cache
def load(directory: Path | None = None) -> Kernels:
    """Once per process: torch cannot unload a library of ops, nor load a second one of the same names."""
    directory = directory or build.kernels_dir()
    if reason := build.why_unusable(directory):
        return Kernels(None, reason)
    try:
        torch.ops.load_library(str(directory / build.LIBRARY))
    except OSError as exc:
        return Kernels(None, f"the C kernels failed to load: {exc}")
    _register_fakes()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir(build.read_manifest(directory)["key"],
                                                               os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    if wanted := os.environ.get("SY_CPU_KERNELS"):  # another variant than the best, to measure an older CPU's
        if wanted not in torch.ops.switchyard_cpu.variants():
            return Kernels(None, f"SY_CPU_KERNELS={wanted}: this CPU runs {torch.ops.switchyard_cpu.variants()}")
        torch.ops.switchyard_cpu.use_variant(wanted)
    variant = torch.ops.switchyard_cpu.variant()
    return Kernels(variant, f"C kernels ({variant})")


def inductor_cache_dir(build_key: str, current: str | None) -> str:
    """Inductor's cache keys a compiled graph by its ops' names, not by this library's code: a graph
    compiled against another build of these kernels (another op schema) would be loaded from it and
    crash. So each build compiles into a directory of its own, beneath the one torch would use."""
    name = f"switchyard-kernels-{build_key[:16]}"
    if current is None:  # imported only here: Inductor's import costs seconds of a worker's start
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        current = default_cache_dir()
    return current if Path(current).name == name else str(Path(current) / name)


def _register_fakes() -> None:
    """Shapes for torch.compile: what each op returns, without running it."""
    lib = "switchyard_cpu::"

    @torch.library.register_fake(lib + "quant_linear")
    def _(x, qweight, scales, lows, bits, bias, supers=None, codebook=None, int8_activations=False):
        return x.new_empty(*x.shape[:-1], qweight.shape[0] * 16)

    @torch.library.register_fake(lib + "add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format), \
            torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "rotary")
    def _(x, cos, sin):
        return x.new_empty(x.shape)

    @torch.library.register_fake(lib + "silu_and_mul")
    def _(gate_up):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @torch.library.register_fake(lib + "decode_attention")
    def _(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0):
        return torch.empty_like(q, memory_format=torch.contiguous_format)
