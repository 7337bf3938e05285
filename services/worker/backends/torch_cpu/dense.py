"""float32 and bfloat16 Linears on oneDNN with prepacked weights.

torch's `F.linear` on float32 goes to MKL's sgemm. On an AMD EPYC with AVX2 (2 cores), oneDNN's
matmul over a weight reordered once into its blocked layout ran 1.6-2x faster for 1 to 64 rows
(bench/profile_step.py), the batches a decode step has; `pack_linears` gives the worker's model
that path. On an AMD EPYC with AVX-512 BF16, the same for bfloat16 ran 1.2-1.9x faster than
`F.linear` for 8 to 64 rows (20 distinct 3072x576 weights, docs/benchmarks.md), so bfloat16 is
packed too where oneDNN has bf16 instructions to run it on. The packed weight is an opaque oneDNN
tensor, which torch.compile cannot take as a graph input, so a model whose decode layers are
compiled keeps its plain Linears. Quantized Linears are quant_linear's (quantization.py).
"""

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
