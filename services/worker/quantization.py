"""Weight-only int8 (`--quantization int8`): each Linear's weight as int8 with one scale per output
channel (symmetric). Small batches (decode at low concurrency, bound by reading the weights) run
torch's int8 GEMV kernel over the int8 bytes; larger batches (bound by arithmetic) run a GEMM over
the same int8 values dequantized once at load. Either way the model computes with the int8 weights."""

from __future__ import annotations

import torch
from torch import nn

SMALL_BATCH = 8  # rows up to which the int8 kernel beats the dense GEMM on this CPU (bench/profile_step.py)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        qweight = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        dtype = linear.weight.dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("dequantized", (qweight.float() * scale[:, None]).to(dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= SMALL_BATCH:
            out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scale)
            out = out.reshape(*x.shape[:-1], -1)
            return out if self.bias is None else out + self.bias
        return nn.functional.linear(x, self.dequantized, self.bias)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Every Linear, the output head included, becomes an Int8Linear (the embedding table stays)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model
