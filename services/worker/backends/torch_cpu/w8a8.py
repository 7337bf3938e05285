"""int8 weights and int8 activations (`--quantization w8a8`) on fbgemm's u8 x s8 GEMM; a row's
result depends on the row alone, so a request's tokens do not depend on its batch."""

from __future__ import annotations

import itertools
import warnings
import weakref

import torch
from torch import nn

ROW_SCALE = 1 / 127  # a row in [-1, 1] -> uint8 in [1, 255]
ROW_ZERO_POINT = 128
WEIGHT_LEVELS = 63  # |w| <= 63: two u8 x s8 products stay under 2^15
_PACKED: dict[int, torch.ScriptObject] = {}  # handle -> fbgemm's packed weight
_handles = itertools.count()


def available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def _gemm(rows: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(rows, ROW_SCALE, ROW_ZERO_POINT, packed)


# a plain library op with a CPU kernel: torch.library.custom_op's wrapper cost twice the dispatch
# (~30 us against ~15 a call, 121 calls a step)
torch.library.define("switchyard::int8_linear", "(Tensor rows, Tensor handle, int out_features) -> Tensor")


@torch.library.impl("switchyard::int8_linear", "cpu")
def _int8_linear(rows: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    """[n, in] float32 rows within [-1, 1] -> [n, out] float32, by the packed weight `handle` names."""
    return _gemm(rows, _PACKED[int(handle)])


@torch.library.register_fake("switchyard::int8_linear")
def _(rows: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], out_features)


def _prepack_on_fbgemm(qweight: torch.Tensor) -> torch.ScriptObject:
    """The engine at prepack time picks the kernels the packed weight runs on; fbgemm's, whatever
    the process's default engine is."""
    if not available():
        raise RuntimeError(f"quantization w8a8 needs fbgemm (x86 builds of torch); this torch has "
                           f"{torch.backends.quantized.supported_engines}")
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        return torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = engine


class W8A8Linear(nn.Module):
    """- Weights: int8, one scale per output channel (symmetric), in [-63, 63], packed once at load.
    - Activations: int8 per token, at every call. Each row is divided by its own max |x|, so it lies
      in [-1, 1]; fbgemm quantizes it on a fixed grid (ROW_SCALE, ROW_ZERO_POINT: all 255 levels of
      a uint8); the int32 sums come back as float32 and the row is multiplied by its max again.
      A per-tensor scale (torch's `quantized.linear_dynamic`) would make a row depend on its batch.
    - Why the weights have 7 bits: AVX2's vpmaddubsw adds two u8 x s8 products into an int16 and
      saturates; with |w| <= 63 two products stay under 2^15. 7-bit activations and 8-bit weights
      (torch's `reduce_range`) doubled the error of the default model's Linears (activations
      dominate it), and 8 bits of both saturated in one of them (tests/test_w8a8.py builds the case).
    - Under torch.compile the GEMM is the library op `switchyard::int8_linear` over a handle: a
      one-element buffer that names the packed weight (a TorchScript object, which a graph cannot
      take) in this module's registry, so each run of layers sharing a compiled graph passes its own.
    Measured against the other CPU paths in docs/benchmarks.md ("w8a8")."""

    not_in_graph = ("key",)  # the eager steps' handle: a compiled graph reads the `handle` buffer

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / WEIGHT_LEVELS
        with warnings.catch_warnings():  # torch deprecates quantized tensors; fbgemm's prepack takes only them
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scale.double(), torch.zeros_like(scale, dtype=torch.long),
                                                 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = linear.out_features
        self.packed_bytes = qweight.numel()  # held by fbgemm, outside the module's buffers
        key = next(_handles)
        _PACKED[key] = _prepack_on_fbgemm(qweight)
        weakref.finalize(self, _PACKED.pop, key, None)
        self.key = key
        self.register_buffer("handle", torch.tensor(key))

    @property
    def dequantized(self) -> torch.Tensor:
        """The int8 weight as [out, in] float32 values."""
        qweight, _ = torch.ops.quantized.linear_unpack(_PACKED[self.key])
        return qweight.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        row_max = rows.abs().amax(-1, keepdim=True).clamp(min=1e-30)
        rows = rows / row_max
        if torch.compiler.is_dynamo_compiling():
            out = torch.ops.switchyard.int8_linear(rows, self.handle, self.out_features)
        else:  # the same GEMM without the op's dispatch
            out = _gemm(rows, _PACKED[self.key])
        out = out * row_max
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)
