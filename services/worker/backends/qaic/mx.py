"""OCP Microscaling (MX v1.0) formats as packed storage: MXFP6 (E2M3) weights and MXINT8 KV.

A block is 32 elements along the last dimension sharing one E8M0 scale (a biased power-of-two
exponent, byte 127 = 2^0). The rules followed (spec section 6.3): the shared exponent is
floor(log2(max |v|)) - emax_elem, clamped to E8M0's range [-127, 127] (an all-zero block takes
-127); each v / 2^shared is rounded to the element format round-half-to-even and saturated to its
largest magnitude. MXFP6 packs four 6-bit codes in three bytes (6.25 bits an element with its
scale); MXINT8 stores two's-complement bytes read as q * 2^-6, clamped symmetrically to +-127 (the
reference library's choice: -128 is never written, and reads back as -2 if it is found).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
E8M0_BIAS = 127
FP6_EMAX, FP6_MAX = 2, 7.5  # E2M3: largest normal 2^2 * 1.875
INT8_EMAX, INT8_MAX_CODE = 0, 127  # elements q * 2^-6: largest 127/64 = 2^0 * 1.984375


def _fp6_values() -> torch.Tensor:
    """The 64 E2M3 codes' values: sign bit 5, exponent bits 4-3 (bias 1), mantissa bits 2-0."""
    codes = torch.arange(64)
    exp, mant = (codes >> 3) & 3, (codes & 7).double()
    magnitude = torch.where(exp == 0, mant / 8, (1 + mant / 8) * torch.pow(2.0, (exp - 1).double()))
    return torch.where(codes >= 32, -magnitude, magnitude).float()


FP6_VALUES = _fp6_values()


def shared_exponents(blocks: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """blocks [..., 32] -> the unbiased shared exponent of each block (int32)."""
    amax = blocks.abs().amax(-1).float()
    _, exp = torch.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1): floor(log2(amax)) = exp - 1
    shared = (exp - 1 - emax_elem).clamp(-E8M0_BIAS, E8M0_BIAS)
    return torch.where(amax == 0, torch.full_like(shared, -E8M0_BIAS), shared).to(torch.int32)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MX blocks are {BLOCK} elements along the last dimension; it has {x.shape[-1]}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _scale(shared: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, shared.double()).float().unsqueeze(-1)  # exact for -127..127 in float32


# ---- MXFP6 (E2M3) --------------------------------------------------------------------------------

def fp6_encode(x: torch.Tensor) -> torch.Tensor:
    """Values already divided by their block's scale -> 6-bit codes (uint8), round-half-to-even, saturating."""
    magnitude = x.abs().clamp(max=FP6_MAX)
    # the grid's step: 1/8 below 2 (subnormals and exponent 1), then 2^(e - 3)
    _, exp = torch.frexp(magnitude)
    step = torch.pow(2.0, (exp - 1).clamp(min=0).float() - 3)
    q = torch.round(magnitude / step) * step  # torch.round is half-to-even
    q_exp = torch.frexp(q)[1] - 1  # q >= 1: 2^q_exp <= q < 2^(q_exp + 1)
    normal = q >= 1
    field_exp = torch.where(normal, q_exp + 1, torch.zeros_like(q_exp))
    mant = torch.where(normal, (q / torch.pow(2.0, q_exp.float()) - 1) * 8, q * 8)
    code = (field_exp << 3) | mant.round().to(torch.int32)
    negative = torch.signbit(x) & (code != 0)  # -0 is stored as +0
    return (code | (negative.to(torch.int32) << 5)).to(torch.uint8)


def pack6(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] 6-bit codes, n a multiple of 4 -> [..., 3n/4] bytes (little-endian bit order)."""
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 4)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)  # 24 bits
    packed = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return packed.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack6(packed: torch.Tensor) -> torch.Tensor:
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    codes = torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1)
    return codes.reshape(*packed.shape[:-1], -1).to(torch.uint8)


@dataclass
class MXFP6Tensor:
    """A [rows, cols] matrix in MXFP6: packed codes [rows, cols * 3/4] and E8M0 scales [rows, cols/32]."""

    packed: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def encode(cls, x: torch.Tensor) -> MXFP6Tensor:
        blocks = _blocks(x)
        shared = shared_exponents(blocks, FP6_EMAX)
        codes = fp6_encode(blocks / _scale(shared)).reshape(x.shape)
        return cls(pack6(codes), (shared + E8M0_BIAS).to(torch.uint8), tuple(x.shape))

    def decode(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = unpack6(self.packed).long()
        values = FP6_VALUES.to(codes.device)[codes].reshape(*self.shape[:-1], -1, BLOCK)
        return (values * _scale(self.scales.to(torch.int32) - E8M0_BIAS)).reshape(self.shape).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel()


# ---- MXINT8 --------------------------------------------------------------------------------------

def int8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] -> (int8 elements [..., n], E8M0 scales uint8 [..., n/32])."""
    blocks = _blocks(x)
    shared = shared_exponents(blocks, INT8_EMAX)
    q = torch.round(blocks / _scale(shared) * 64).clamp(-INT8_MAX_CODE, INT8_MAX_CODE)
    return q.to(torch.int8).reshape(x.shape), (shared + E8M0_BIAS).to(torch.uint8)


def int8_decode(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    blocks = q.float().reshape(*q.shape[:-1], -1, BLOCK) / 64
    return (blocks * _scale(scales.to(torch.int32) - E8M0_BIAS)).reshape(q.shape).to(dtype)
