"""The program split across `num_devices` emulated devices by tensor slicing: each device holds a
contiguous slice of every matmul's output features and computes it on its own thread; the slices
are gathered (concatenated) after each matmul. Norms, rotary and attention are replicated, so
they run once. Output features split whole, so each device's slice of an MXFP6 weight keeps its
blocks (they run along the input dimension), and the gathered result equals the unsliced one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from services.worker.backends.qaic.mx import MXFP6Tensor
from services.worker.backends.qaic.mx_linear import MXFP6Linear


class EmulatedDevices:
    def __init__(self, num_devices: int):
        self.num_devices = num_devices
        self.pool = ThreadPoolExecutor(num_devices, thread_name_prefix="qaic-device")

    def gather(self, shards: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
        """Each device's shard over the same input (inference mode is per thread: set it there)."""
        def run(shard: nn.Module) -> torch.Tensor:
            with torch.inference_mode():
                return shard(x)
        return torch.cat(list(self.pool.map(run, shards)), dim=-1)


class SlicedLinear(nn.Module):
    def __init__(self, shards: list[nn.Module], devices: EmulatedDevices):
        super().__init__()
        self.shards = nn.ModuleList(shards)
        self.devices = devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.devices.gather(list(self.shards), x)


def _slices(rows: int, n: int) -> list[tuple[int, int]]:
    bounds = [rows * i // n for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _shard(linear: nn.Module, start: int, end: int) -> nn.Module:
    bias = None if linear.bias is None else linear.bias[start:end]
    if isinstance(linear, MXFP6Linear):
        part = MXFP6Tensor(linear.packed[start:end].clone(), linear.scales[start:end].clone(),
                           (end - start, linear.shape[1]))
        return MXFP6Linear(part, bias, linear.weight.dtype, linear.packed.device)
    shard = nn.Linear(linear.in_features, end - start, bias=bias is not None, device="meta")
    shard.weight = nn.Parameter(linear.weight[start:end].clone(), requires_grad=False)
    if bias is not None:
        shard.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return shard


def slice_across(model: nn.Module, devices: EmulatedDevices) -> list[int]:
    """Every Linear (plain or MXFP6) becomes a SlicedLinear over the devices; returns each device's
    weight bytes (as stored: MXFP6 images, or the dtype's)."""
    held = [0] * devices.num_devices
    for _, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            if not isinstance(child, (nn.Linear, MXFP6Linear)):
                continue
            rows = child.shape[0] if isinstance(child, MXFP6Linear) else child.out_features
            shards = [_shard(child, a, b) for a, b in _slices(rows, devices.num_devices)]
            for d, shard in enumerate(shards):
                held[d] += shard.image_bytes if isinstance(shard, MXFP6Linear) else \
                    shard.weight.numel() * shard.weight.element_size()
            setattr(parent, attr, SlicedLinear(shards, devices))
    return held
