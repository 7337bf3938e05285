"""Weight-only quantization (`--quantization int8 | int4`).

- int8: each Linear's weight as int8 with one scale per output channel (symmetric).
- int4: 4-bit values in groups of 32 along the input dimension, each group with its own scale and
  zero point (asymmetric), in torch's packed layout; the same scheme as the Q4_1 blocks of the
  default GGUF, whose own values, scales and minimums are kept (loader/gguf_blocks.py).
- gguf (the default on a GGUF with Q4_0 / Q4_1 / Q8_0 tensors): exactly those weights keep the
  file's blocks, on the int4 kernel (Q8_0 as two 4-bit halves); the others stay as the file has them.

Small batches (decode at low concurrency, bound by reading the weights) run torch's int8 / int4
GEMV kernels over the packed bytes; larger batches (bound by arithmetic) run a dense GEMM over the
same quantized values dequantized once at load, in the model's dtype (on oneDNN's packed
weights, dense.py). Either way the model computes
with the quantized weights. torch's weight-only kernels are fast only for bfloat16 rows (with
float32 rows they ran 2-13x slower than the dense GEMM on an AVX2 CPU, bench/profile_step.py), so a
float32 model hands them its rows rounded to bfloat16 and takes float32 back: the GEMV then reads
the packed bytes, and every other op (and every larger batch) stays float32.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.backends.torch_cpu import dense
from services.worker.backends.torch_cpu.w8a8 import W8A8Linear
from services.worker.loader import gguf_blocks
from services.worker.loader.gguf_blocks import Int4Blocks, for_module

# rows up to which the kernels beat the dense GEMM (bench/profile_step.py): a float32 GEMM reads twice
# the bytes of a bfloat16 one, so against it the kernels win for more rows
SMALL_BATCH = {torch.bfloat16: 4, torch.float32: 8}
KERNEL_DTYPE = torch.bfloat16  # the rows the kernels take
INT4_GROUP = 32


class _WeightOnlyLinear(nn.Module):
    def __init__(self, linear: nn.Linear, dequantized: torch.Tensor):
        super().__init__()
        # the dense path's weight: oneDNN's packed copy for float32 (dense.py), else plain
        self.is_packed = dense.available(linear.weight.dtype)
        weight = dequantized.to(linear.weight.dtype)
        self.register_buffer("dense_weight", dense.pack(weight) if self.is_packed else weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.small_batch = SMALL_BATCH.get(linear.weight.dtype, 0)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, in] bfloat16 rows -> [n, out] bfloat16."""
        raise NotImplementedError

    def uses_kernel(self, rows: torch.Tensor) -> bool:
        return rows.shape[0] <= self.small_batch

    @property
    def dequantized(self) -> torch.Tensor:
        """The quantized weight as [out, in] values of the model's dtype."""
        return self.dense_weight.to_dense() if self.is_packed else self.dense_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        # compiled decode steps (up to 8 rows) always take the kernel: a packed weight cannot be traced
        if self.uses_kernel(rows) or (self.is_packed and torch.compiler.is_dynamo_compiling()):
            out = self.kernel(rows.to(KERNEL_DTYPE).contiguous()).to(x.dtype).reshape(*x.shape[:-1], -1)
            return out if self.bias is None else out + self.bias
        if self.is_packed:
            return dense.linear(x, self.dense_weight, self.bias)
        return nn.functional.linear(x, self.dense_weight, self.bias)


class Int8Linear(_WeightOnlyLinear):
    def __init__(self, linear: nn.Linear):
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        qweight = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        super().__init__(linear, qweight.float() * scale[:, None])
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scale)


class Int4Linear(_WeightOnlyLinear):
    def __init__(self, linear: nn.Linear, blocks: Int4Blocks | None = None):
        """blocks: the GGUF's own values, scales and minimums for this weight, kept as they are (a Q8_0
        weight as two 4-bit halves, `folds` = 2: the kernel takes each row twice)."""
        n, k = linear.weight.shape
        folds = 1 if blocks is None else blocks.folds
        if blocks is None:
            groups = linear.weight.detach().float().view(n, k // INT4_GROUP, INT4_GROUP)
            low = groups.amin(-1, keepdim=True)
            scale = (groups.amax(-1, keepdim=True) - low).clamp(min=1e-8) / 15
            q = torch.round((groups - low) / scale).clamp(0, 15)
            dequantized = (q * scale + low).view(n, k)
        else:
            q = blocks.q.view(n, -1, INT4_GROUP).float()
            scale, low = blocks.scale[..., None], blocks.low[..., None]
            dequantized = blocks.dequantized
        super().__init__(linear, dequantized)
        self.folds = folds
        # torch's convention: w = (q - 8) * scale + zero, scales and zeros as [k / group, n, 2]
        zero = low + 8 * scale
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.view(n, -1).to(torch.int32), 2))
        self.register_buffer("scales_and_zeros", torch.stack(
            [scale.view(n, -1), zero.view(n, -1)], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE))

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        if self.folds > 1:
            rows = rows.repeat(1, self.folds)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_and_zeros)


def quantize(model: nn.Module, method: str, gguf_blocks: dict[str, Int4Blocks] | None = None) -> nn.Module:
    """Every Linear, the output head included, becomes a quantized one (the embedding table stays).
    int4 needs the input size to be a multiple of 32; a Linear that is not stays int8. w8a8 (int8
    activations too) is w8a8.py's. gguf_blocks (a GGUF with Q4_0 / Q4_1 / Q8_0 tensors): those
    weights keep the file's own blocks (Q8_0's at 8 bits); under int4 a weight the file holds as
    floats becomes int8, under `gguf` (the default, --quantization auto) it stays as it is."""
    if method == "none":
        return model
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                where = f"{path}.{child_name}" if path else child_name
                setattr(module, child_name, _quantized(child, method, gguf_blocks, where))
    return model


def _quantized(linear: nn.Linear, method: str, gguf_blocks: dict | None, path: str) -> nn.Module:
    if method == "w8a8":
        return W8A8Linear(linear)
    if method in ("int4", "gguf") and gguf_blocks is not None:
        blocks = for_module(gguf_blocks, path)
        if blocks is not None:
            return Int4Linear(linear, blocks)
        return linear if method == "gguf" else Int8Linear(linear)
    if method == "gguf":
        return linear
    if method == "int4" and linear.in_features % INT4_GROUP == 0:
        return Int4Linear(linear)
    return Int8Linear(linear)


def native_int4_blocks(loaded, method: str) -> dict[str, Int4Blocks] | None:
    """int4 or gguf on a GGUF that has Q4_0 / Q4_1 / Q8_0 tensors: the file's own blocks (loader/gguf_blocks.py)."""
    kind, _, path = loaded.source.partition(":")
    if method not in ("int4", "gguf") or kind != "gguf":
        return None
    return gguf_blocks.read(path, loaded.config) or None
