"""A Linear whose weight is stored in MXFP6 (`mxfp6_matmul`): the packed codes and E8M0 scales are
the program's weight image; the emulation multiplies by their values, decoded once at load.

Every MXFP6 value (a 4-significant-bit element times a power of two) is exact in bfloat16 and
float32, so the decoded copy computes exactly what the packed weight holds. A float32 copy runs on
oneDNN with its weight prepacked, as the torch CPU backend's Linears do (torch_cpu/dense.py).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.backends.qaic.mx import MXFP6Tensor
from services.worker.backends.torch_cpu import dense


class MXFP6Linear(nn.Module):
    def __init__(self, weight: MXFP6Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.register_buffer("packed", weight.packed.to(device))
        self.register_buffer("scales", weight.scales.to(device))
        self.shape = weight.shape
        self.is_packed = dense.available(dtype) and torch.device(device).type == "cpu"
        decoded = weight.decode(dtype).to(device)
        self.register_buffer("dense_weight", dense.pack(decoded) if self.is_packed else decoded, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device, dtype), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The stored values, decoded: [out, in] in the compute dtype."""
        return self.dense_weight.to_dense() if self.is_packed else self.dense_weight

    @property
    def image_bytes(self) -> int:
        """What the device stores for this weight: 6 bits an element plus a byte per 32."""
        return self.packed.numel() + self.scales.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_packed:
            return dense.linear(x, self.dense_weight, self.bias)
        return nn.functional.linear(x, self.dense_weight, self.bias)


def linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(qualified name, parent, attribute, Linear) of every Linear: the matmuls mxfp6_matmul stores."""
    found = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if isinstance(child, nn.Linear):
                found.append((f"{parent_name}.{attr}".lstrip("."), parent, attr, child))
    return found


def encode_weights(model: nn.Module) -> dict[str, MXFP6Tensor]:
    """The model's weight image: each Linear's weight in MXFP6 (blocks of 32 along its input)."""
    return {name: MXFP6Tensor.encode(linear.weight.detach().cpu()) for name, _, _, linear in linears(model)}


def install(model: nn.Module, image: dict[str, MXFP6Tensor], dtype: torch.dtype,
            device: torch.device | str = "cpu") -> None:
    """Each Linear becomes an MXFP6Linear over its encoded weight (kept on the host: the cache's)."""
    for name, parent, attr, linear in linears(model):
        setattr(parent, attr, MXFP6Linear(image[name], linear.bias, dtype, device))
