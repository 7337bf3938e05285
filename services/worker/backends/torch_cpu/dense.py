"""float32 and bfloat16 Linears on oneDNN with prepacked weights, the dense path's matmul
(docs/benchmarks.md measures it against F.linear)."""

from __future__ import annotations

import torch
from torch import nn


def available(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 or bfloat16 -> the same weight in oneDNN's layout (`.to_dense()` gives it back)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    """A weight reordered once into oneDNN's blocked layout: for the 1 to 64 rows a decode step has,
    faster than F.linear (MKL's sgemm) in float32, and in bfloat16 where oneDNN has bf16
    instructions. The packed weight is an opaque oneDNN tensor, which torch.compile cannot take as
    a graph input, so a model whose decode layers are compiled keeps its plain Linears."""

    def __init__(self, linear_: nn.Linear):
        super().__init__()
        self.register_buffer("packed", pack(linear_.weight))
        self.bias = None if linear_.bias is None else nn.Parameter(linear_.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.bias)


def pack_linears(model: nn.Module) -> nn.Module:
    """Every float32 (and bfloat16) nn.Linear becomes a PackedLinear (a tied output head gets its own copy)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and available(child.weight.dtype):
                setattr(module, name, PackedLinear(child))
    return model
