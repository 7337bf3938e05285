"""A quantized safetensors checkpoint's Linears (AWQ, GPTQ, compressed-tensors) as QuantBlocks: the
file's integers, with float32 scales and lows such that w = q * scale + low is the format's own
dequantization, (q - zero) * scale, to the bit (exact where the file's scales are 16-bit floats).

The layouts, as each format's reference code packs them (int32 words, value i at bits [b*i, b*i + b)):
- GPTQ: qweight [in / (32/b), out] packed along the inputs; qzeros [groups, out / (32/b)] along the
  outputs, each zero stored minus one in the original format (checkpoint_format "gptq", not
  "gptq_v2"); scales [groups, out]; g_idx [in], each input's group (act-order: not in order).
- AWQ (GEMM): qweight [in, out / 8] and qzeros [groups, out / 8] packed along the outputs in the
  order 0 2 4 6 1 3 5 7; scales [groups, out].
- compressed-tensors pack-quantized: weight_packed [out, in * b / 32] of signed values plus 2^(b-1),
  along the inputs; weight_zero_point (asymmetric) the same along the outputs; weight_scale
  [out, groups] (a channel: one group); weight_shape. int-quantized: an int8 `weight` as it is.
  float-quantized (fp8): a float8_e4m3fn `weight` kept as its codes, w = code * scale (a channel's
  or the tensor's scale, repeated per group).
"""

from __future__ import annotations

import torch

from services.worker.loader.quant_blocks import QuantBlocks
from services.worker.quant_scheme import QuantScheme

AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # output column j of a word is its value AWQ_COLUMNS[j]
# a quantized module's tensors, by the suffix after its name
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point",
            "weight_shape", "weight")
_MARKERS = ("qweight", "weight_packed", "weight_scale")  # a module with one of these is quantized


def quantized_modules(names: list[str]) -> dict[str, dict[str, str]]:
    """{module: {suffix: tensor name}} for the quantized modules among a file's tensor names."""
    by_module: dict[str, dict[str, str]] = {}
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix in SUFFIXES:
            by_module.setdefault(module, {})[suffix] = name
    return {m: parts for m, parts in by_module.items() if any(k in parts for k in _MARKERS)}


def _values(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits unsigned values each, unpacked along `dim` (value i of a word
    at bits [bits * i, bits * i + bits))."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:  # [a, n] -> [a * per_word, n]
        v = (words[:, None, :] >> shifts[None, :, None]) & mask
        return v.reshape(-1, words.shape[1])
    v = (words[:, :, None] >> shifts[None, None, :]) & mask  # [a, n] -> [a, n * per_word]
    return v.reshape(words.shape[0], -1)


def _kernel_group(file_group: int, bits: int) -> int:
    """The largest group quant_linear takes in float32 scales that divides the file's (scales are
    repeated for it), or the file's own where none does (its Linear is then dequantized)."""
    taken = (128, 64, 32) if bits == 4 else (128, 32)
    return next((g for g in taken if file_group % g == 0), file_group)


def _blocks(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: int,
            perm: torch.Tensor | None = None) -> QuantBlocks:
    """q [out, in] unsigned 0..2^bits - 1 and per-group zero [out, groups] and scale [out, groups],
    w = (q - zero) * scale -> QuantBlocks. 4 bits keep q unsigned, low = -zero * scale; 8 bits keep
    q - 128 as int8, low = (128 - zero) * scale, none where every zero is 128 (symmetric). Either
    product is exact in float32 for a 16-bit scale."""
    n, k = q.shape
    scale = scale.float()
    file_group = k // scale.shape[1]
    group = _kernel_group(file_group, bits)
    if group != file_group:
        zero, scale = (t.repeat_interleave(file_group // group, dim=1) for t in (zero, scale))
    if bits == 4:
        return QuantBlocks(q.to(torch.uint8), scale, -zero.float() * scale, 4, group, torch.float32, perm)
    low = None if bool((zero == 128).all()) else (128 - zero).float() * scale
    return QuantBlocks((q - 128).to(torch.int8), scale, low, 8, group, torch.float32, perm)


def _act_order(g_idx: torch.Tensor, groups: int, k: int, where: str) -> torch.Tensor | None:
    """GPTQ's g_idx: None where input i is in group i // (k / groups); else the inputs sorted by
    group (each group must hold k / groups of them)."""
    size = k // groups
    in_order = torch.arange(k) // size
    if torch.equal(g_idx.long(), in_order):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], in_order):
        raise ValueError(f"{where}: g_idx gives groups of unequal sizes; each must hold {size} inputs")
    return perm


def _gptq(t: dict[str, torch.Tensor], scheme: QuantScheme, where: str) -> QuantBlocks:
    bits = scheme.bits
    q = _values(t["qweight"], bits, 0).T.contiguous()  # [out, in]
    n, k = q.shape
    scales = t["scales"]  # [groups, out]
    zeros = _values(t["qzeros"], bits, 1)[:, :n] + (1 if scheme.v1_zeros else 0)  # [groups, out]
    perm = _act_order(t["g_idx"], scales.shape[0], k, where) if "g_idx" in t else None
    if perm is not None:
        q = q[:, perm].contiguous()
    return _blocks(q, zeros.T.contiguous(), scales.T.contiguous(), bits, perm)


def _awq(t: dict[str, torch.Tensor]) -> QuantBlocks:
    def columns(words: torch.Tensor) -> torch.Tensor:  # [a, out / 8] -> [a, out] in column order
        v = _values(words, 4, 1)
        return v.view(v.shape[0], -1, 8)[:, :, list(AWQ_COLUMNS)].reshape(v.shape[0], -1)

    q, zeros = columns(t["qweight"]).T.contiguous(), columns(t["qzeros"])  # [out, in], [groups, out]
    return _blocks(q, zeros.T.contiguous(), t["scales"].T.contiguous(), 4)


def _float_codes(weight: torch.Tensor, scale: torch.Tensor) -> QuantBlocks | None:
    """float-quantized e4m3 by channel or tensor: the codes kept, w = code * scale, the scale repeated
    per group of 128 (or 32); None where the inputs take neither (dequantize() then)."""
    n, k = weight.shape
    group = _kernel_group(k, 8)
    if weight.dtype != torch.float8_e4m3fn or group not in (128, 32):
        return None
    scale = scale.float().reshape(-1, 1).expand(n, k // group).contiguous()  # [out, 1] or a scalar
    return QuantBlocks(weight, scale, None, 8, group, torch.float32)


def _compressed(t: dict[str, torch.Tensor], where: str) -> QuantBlocks | None:
    """pack-quantized, int-quantized or float-quantized (fp8); None: dequantize() only."""
    scale = t["weight_scale"]
    if "weight_packed" in t:
        n, k = (int(x) for x in t["weight_shape"])
        bits = 32 * t["weight_packed"].shape[1] // k
        if bits not in (4, 8) or 32 * t["weight_packed"].shape[1] != bits * k:
            raise ValueError(f"{where}: weight_packed {tuple(t['weight_packed'].shape)} is not int4 or int8 "
                             f"values of [{n}, {k}]")
        q = _values(t["weight_packed"], bits, 1)[:, :k]  # signed value + 2^(bits - 1)
        offset = 1 << (bits - 1)
        zp = t.get("weight_zero_point")
        zero = offset + (torch.zeros_like(scale, dtype=torch.int32) if zp is None else
                         _values(zp, bits, 0)[:n] - offset)
        return _blocks(q, zero, scale, bits)  # 8 bits: offset by 128, as _blocks takes them
    weight = t["weight"]
    if weight.dtype != torch.int8:
        return _float_codes(weight, scale)
    if scale.dim() == 0 or scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(weight.shape[0], 1)
    zp = t.get("weight_zero_point")
    zero = 128 + (torch.zeros_like(scale, dtype=torch.int32) if zp is None else zp.to(torch.int32).reshape(scale.shape))
    return _blocks(weight.to(torch.int32) + 128, zero, scale, 8)


def decode(tensors: dict[str, torch.Tensor], scheme: QuantScheme, where: str) -> QuantBlocks | None:
    """A module's tensors by suffix -> its QuantBlocks; None where the kernel takes no form of it (dequantize())."""
    if scheme.method == "gptq":
        return _gptq(tensors, scheme, where)
    if scheme.method == "awq":
        return _awq(tensors)
    return _compressed(tensors, where)


def dequantize(tensors: dict[str, torch.Tensor], scheme: QuantScheme, where: str) -> torch.Tensor:
    """A module's float32 weight [out, in], as the format's own dequantization computes it."""
    blocks = decode(tensors, scheme, where)
    if blocks is not None:
        return blocks.dequantized
    weight, scale = tensors["weight"], tensors["weight_scale"].float()
    if scale.dim() == 2 and scale.shape[1] == 1:  # a channel's
        return weight.float() * scale
    return weight.float() * scale.reshape(())

