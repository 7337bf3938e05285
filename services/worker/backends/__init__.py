"""Accelerator backends, a folder each behind the protocol in base.py; `create_backend` picks one.

A backend's module is imported only when it is asked for, so the CPU worker never imports triton;
this package itself imports no torch (the launcher reads the CPU kernels' build from it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from shared.config import ConfigError

if TYPE_CHECKING:
    from services.worker.backends.base import Backend
    from services.worker.backends.spec import WorkerSpec

# --device -> the module whose `create(spec)` builds the backend
BACKENDS = {
    "cpu": "services.worker.backends.torch_cpu.backend:TorchCpuBackend",
    "cuda": "services.worker.backends.cuda.backend:CudaBackend",
    "qaic": "services.worker.backends.qaic.backend:QaicBackend",
}


def create_backend(device: str, spec: WorkerSpec) -> Backend:
    if device not in BACKENDS:
        raise ConfigError(f"--device must be one of {', '.join(BACKENDS)}, got {device!r}")
    module, cls = BACKENDS[device].split(":")
    return getattr(importlib.import_module(module), cls).create(spec.with_dtype_for(device))
