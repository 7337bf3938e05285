"""llama.cpp's k-quants and IQ4 blocks as quant_linear's formats: integer values in groups of 32 or
16 inputs, each group's scale (and low) in the file's two levels, an int8 times a float16 per 256.

A k-quant super-block is 256 weights with an fp16 d (and dmin) and a small integer scale (and
minimum) per sub-block: w = (d * sc) * q - (dmin * m). d * sc and dmin * m are exact in float32
(an 11-bit significand times a 6-bit integer), and so is (d * sc) * q where there is a low, so
fma(q, d * sc, -(dmin * m)) is the one rounding gguf's dequantize makes: the weights are its own,
to the bit. sc and m are kept as int8 (the scale and low of a group), d and -dmin as the supers.
Q5_K's values are kept in 5 bits, Q6_K's in 6, Q3_K's in 4 (q + 4, its low -4 d sc: the same
weights, a zero +0 where gguf's is -0); IQ4's as the file's 4-bit indices with their codebook.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 256  # weights per super-block
FOUR_D_FITS = 65504 / 4  # float16's largest over 4: Q3_K's -4d exact in float16 below it
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


@dataclass
class Decoded:
    q: np.ndarray  # [rows, k]: uint8 0..15 (bits 4) or 0..31 (bits 5), or int8 (-32..31 for bits 6)
    scale: np.ndarray  # [rows, k / group]: int8 times supers' d; float32 without supers
    low: np.ndarray | None  # [rows, k / group]: int8 times supers' -dmin, or None
    bits: int
    group: int
    half: bool = False  # every scale exact in float16 (kept as such)
    supers: np.ndarray | None = None  # [rows, k / 256, 1 or 2] float32: d (and -dmin), exact in float16
    codebook: np.ndarray | None = None  # [16] int8: the values q's 4-bit indices stand for (IQ4's), or None
    span: int = 0  # the bits q's values span where fewer than `bits` (Q2_K's 2, Q3_K's 3), else 0


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32, from the file's float16."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray, span: int) -> np.ndarray:
    """Bytes in runs of `span`: each run's low nibbles, then its high ones (llama.cpp's order)."""
    runs = raw.reshape(*raw.shape[:-1], -1, 1, span) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (runs & 0x0F).reshape(*raw.shape[:-1], -1)


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit minimums."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    """[rows, row bytes] -> [rows, super-blocks, size]."""
    return raw.reshape(raw.shape[0], -1, size)


def _flat(t: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(t.reshape(t.shape[0], -1))


def _subs(t: np.ndarray) -> np.ndarray:
    """A super-block's small integer scales (or minimums), [rows, super-blocks, n] -> [rows, k / group] int8."""
    return _flat(t.astype(np.int8))


def _supers(*per_block: np.ndarray) -> np.ndarray:
    """[rows, super-blocks, 1] each (d, then -dmin) -> [rows, super-blocks, 1 or 2] float32."""
    return np.ascontiguousarray(np.concatenate(per_block, axis=-1))


def q4_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 144)  # d, dmin, 12 bytes of scales and minimums, 128 of nibbles
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _scale_min_k4(b[..., 4:16])
    q = _nibbles(b[..., 16:], 32)
    return Decoded(_flat(q).astype(np.uint8), _subs(sc), _subs(mn), 4, 32, supers=_supers(d, -dmin))


def q5_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 176)  # d, dmin, 12 bytes of scales, 32 of fifth bits, 128 of nibbles
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _scale_min_k4(b[..., 4:16])
    high = (b[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [.., 8 sub-blocks, 32]
    q = _nibbles(b[..., 48:], 32).reshape(*b.shape[:2], 8, 32) | (high << 4)
    return Decoded(_flat(q).astype(np.uint8), _subs(sc), _subs(mn), 5, 32, supers=_supers(d, -dmin))


def q6_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 210)  # 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d
    low4 = _nibbles(b[..., 0:128].reshape(*b.shape[:2], 2, 64), 64).reshape(*b.shape[:2], 2, 4, 32)
    high2 = (b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = (low4 | (high2 << 4)).astype(np.int8) - np.int8(32)
    sc = b[..., 192:208].copy().view(np.int8)
    return Decoded(_flat(q), _subs(sc), None, 6, 16, supers=_supers(_f16(b[..., 208:210])[..., None]))


def q3_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 110)  # 32 bytes of high-bit masks, 64 of 2-bit pairs, 12 of scales, d
    lo = b[..., 96:104][..., None, :] >> np.array([0, 4], dtype=np.uint8)[:, None]
    hi = b[..., 104:108][..., None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    sc = ((lo.reshape(*b.shape[:2], 16) & 0x0F) | ((hi.reshape(*b.shape[:2], 16) & 3) << 4)).astype(np.int8) - 32
    low2 = (b[..., 32:96].reshape(*b.shape[:2], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    mask = (b[..., 0:32][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    u = low2.reshape(*b.shape[:2], 8, 32) | (mask << 2)  # q + 4: 0..7, a high-bit mask's 1 adding the 4 back
    d = _f16(b[..., 108:110])[..., None]
    if np.abs(d).max(initial=0.0) > FOUR_D_FITS:  # -4d past float16: the values as they are, in 8 bits
        return Decoded(_flat(u.astype(np.int8) - np.int8(4)), _subs(sc), None, 8, 16, supers=_supers(d))
    # w = d sc (u - 4) = u (d sc) + sc (-4 d): 4 bits with a low, its super -4d (exact: a power of two)
    return Decoded(_flat(u).astype(np.uint8), _subs(sc), _subs(sc), 4, 16, supers=_supers(d, -4 * d), span=3)


def q2_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 84)  # 16 bytes of 4-bit scale and minimum pairs, 64 of 2-bit values, d, dmin
    sc = b[..., 0:16]
    d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
    q = (b[..., 16:80].reshape(*b.shape[:2], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    return Decoded(_flat(q).astype(np.uint8), _subs(sc & 0x0F), _subs(sc >> 4), 4, 16, supers=_supers(d, -dmin),
                   span=2)


def iq4_nl(raw: np.ndarray) -> Decoded:
    b = raw.reshape(raw.shape[0], -1, 18)  # d, 16 bytes of codebook indices (blocks of 32)
    q = _nibbles(b[..., 2:], 16)
    return Decoded(_flat(q), _flat(_f16(b[..., 0:2])), None, 4, 32, half=True, codebook=IQ4_VALUES)


def iq4_xs(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 136)  # d, 2 bytes of scales' high bits, 4 of their low nibbles, 128 of indices
    high = (b[..., 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = _nibbles(b[..., 4:8], 4).reshape(*b.shape[:2], 2, 4).swapaxes(-1, -2).reshape(*b.shape[:2], 8)
    sc = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - 32
    q = _nibbles(b[..., 8:].reshape(*b.shape[:2], 8, 16), 16)
    return Decoded(_flat(q), _subs(sc), None, 4, 32, supers=_supers(_f16(b[..., 0:2])[..., None]), codebook=IQ4_VALUES)


DECODERS = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k, "Q3_K": q3_k, "Q2_K": q2_k, "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs}
