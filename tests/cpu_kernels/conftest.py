"""Each instruction-set variant of the C kernels this CPU can run: a test that takes `variant` runs
once per variant, on that variant's kernels."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.kernels.build import variants

ALL_VARIANTS = list(variants())  # what the build makes on this architecture, the best first


@pytest.fixture(params=ALL_VARIANTS)
def variant(request, cpu_kernels) -> str:
    if request.param not in torch.ops.switchyard_cpu.variants():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    previous = torch.ops.switchyard_cpu.use_variant(request.param)
    yield request.param
    torch.ops.switchyard_cpu.use_variant(previous)
