"""The GEMM over a quantized checkpoint's weights (AWQ, GPTQ, compressed-tensors int4/int8/FP8, a
GGUF's blocks): each tile decoded from the file's codes, w = q * scale + low per group of inputs, into
the activations' dtype, then tl.dot; decode's few rows split the inputs across programs (split-K)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from services.worker.backends.cuda.kernels.online_softmax import dot

SPLIT_ROWS = 64  # at most this many rows (decode batches) split K, by the weight's shape alone


@triton.jit
def _per_group(ptr, n, nmask, stride, k0, K, WIDTH: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scales (or lows) of the tile of inputs k0 .. k0 + BLOCK_K for rows n, one per stored column
    ([BLOCK_N, WIDTH]): loaded once per group, never gathered per weight."""
    if GROUP >= BLOCK_K:  # the tile lies in one group
        return tl.load(ptr + n * stride + k0 // GROUP, mask=nmask, other=0.0)[:, None]
    G: tl.constexpr = BLOCK_K // GROUP
    g = k0 // GROUP + tl.arange(0, G)
    s = tl.load(ptr + n[:, None] * stride + g[None, :], mask=nmask[:, None] & (g[None, :] * GROUP < K), other=0.0)
    return tl.reshape(tl.broadcast_to(s[:, :, None], (s.shape[0], G, WIDTH // G)), (s.shape[0], WIDTH))


@triton.jit
def _e4m3(byte):
    """float8 e4m3fn codes, loaded as uint8, as float32: exactly torch's values, subnormals included
    (integer ops alone: any GPU, and the interpreter; the NaN codes, never a weight, read as +-480)."""
    b = byte.to(tl.int32)
    magnitude = b & 0x7F
    normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # the exponent rebiased 7 -> 127
    value = tl.where(magnitude < 8, magnitude.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    return tl.where(b >= 128, -value, value)


@triton.jit
def _scale(s_ptr, d_ptr, n, nmask, stride_s, stride_d, k0, K, WIDTH: tl.constexpr, GROUP: tl.constexpr,
           BLOCK_K: tl.constexpr, SUPERS: tl.constexpr):
    """The tile's scales (or lows), float32 [BLOCK_N, WIDTH or 1]: as stored, or (SUPERS, a k-quant's two
    levels) each group's int8 times its super-block's float32 d: the product flat() would store, exactly."""
    scale = _per_group(s_ptr, n, nmask, stride_s, k0, K, WIDTH, GROUP, BLOCK_K).to(tl.float32)
    if SUPERS:
        scale = scale * _per_group(d_ptr, n, nmask, stride_d, k0, K, WIDTH, 256, BLOCK_K)
    return scale


@triton.jit
def _above_nibbles(h_ptr, n, nmask, stride_h, j, jmask, HIGH: tl.constexpr):
    """The bits above the nibbles of inputs 2j and 2j + 1 (a k-quant's fifth, or fifth and sixth): HIGH
    bits an input, 8 / HIGH inputs a byte in order from the lowest bits up; both inputs in one byte."""
    PER_BYTE: tl.constexpr = 8 // HIGH
    above = tl.load(h_ptr + n[:, None] * stride_h + (2 * j[None, :]) // PER_BYTE,
                    mask=nmask[:, None] & jmask[None, :], other=0).to(tl.int32)
    shift = ((2 * j[None, :]) % PER_BYTE) * HIGH
    return (above >> shift) & ((1 << HIGH) - 1), (above >> (shift + HIGH)) & ((1 << HIGH) - 1)


@triton.jit
def _quant_gemm(x_ptr, q_ptr, h_ptr, s_ptr, l_ptr, d_ptr, dl_ptr, cb_ptr, out_ptr, M, N, K, K_SPLIT, stride_x,
                stride_q, stride_h, stride_s, stride_d, stride_o, stride_split, BITS: tl.constexpr,
                HIGH: tl.constexpr, OFFSET: tl.constexpr, GROUP: tl.constexpr, HAS_LOW: tl.constexpr,
                SUPERS: tl.constexpr, CODEBOOK: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[split, m, n] = sum over this split's k of x[m, k] * (q[n, k] * s[n, k / GROUP] + l[n, k / GROUP]).
    4 bits: q packed two inputs a byte (input 2j in byte j's low nibble, 2j + 1 in its high one), each
    byte loaded once and its nibbles met by the even and the odd inputs (CODEBOOK: indices into IQ4's
    16 int8 values; HIGH: 1 or 2 bits above each nibble from a plane of their own, the value then less
    OFFSET: Q5_K's and Q6_K's). 2 bits: four inputs a byte (Q2_K's; Q3_K's with HIGH 1). 8 bits: a byte
    each (int8, or (FP8) e4m3 codes as uint8). Scales and lows float32 or float16; SUPERS: int8, times
    d and dl per 256 inputs."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    mmask, nmask = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.minimum(K, (split + 1) * K_SPLIT)
    for k0 in range(split * K_SPLIT, k_end, BLOCK_K):
        if BITS == 4:
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # the tile's bytes; inputs 2j and 2j + 1
            jmask = 2 * j < K
            byte = tl.load(q_ptr + n[:, None] * stride_q + j[None, :], mask=nmask[:, None] & jmask[None, :], other=0)
            scale = _scale(s_ptr, d_ptr, n, nmask, stride_s, stride_d, k0, K, BLOCK_K // 2, GROUP, BLOCK_K, SUPERS)
            even, odd = byte & 0xF, byte >> 4
            if HIGH > 0:
                above_even, above_odd = _above_nibbles(h_ptr, n, nmask, stride_h, j, jmask, HIGH)
                even = (even.to(tl.int32) | (above_even << 4)) - OFFSET
                odd = (odd.to(tl.int32) | (above_odd << 4)) - OFFSET
            if CODEBOOK:
                even, odd = tl.load(cb_ptr + even.to(tl.int32)), tl.load(cb_ptr + odd.to(tl.int32))
            w_even = even.to(tl.float32) * scale
            w_odd = odd.to(tl.float32) * scale
            if HAS_LOW:
                low = _scale(l_ptr, dl_ptr, n, nmask, stride_s, stride_d, k0, K, BLOCK_K // 2, GROUP, BLOCK_K, SUPERS)
                w_even += low
                w_odd += low
            xmask = mmask[:, None] & jmask[None, :]
            x_even = tl.load(x_ptr + m[:, None] * stride_x + 2 * j[None, :], mask=xmask, other=0.0)
            x_odd = tl.load(x_ptr + m[:, None] * stride_x + 2 * j[None, :] + 1, mask=xmask, other=0.0)
            acc += dot(x_even, tl.trans(w_even.to(x_even.dtype)), IEEE)
            acc += dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)), IEEE)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            qmask = nmask[:, None] & kmask[None, :]
            if BITS == 2:  # four inputs a byte, each byte met by its four inputs (HIGH: a third bit from a plane)
                q = tl.load(q_ptr + n[:, None] * stride_q + k[None, :] // 4, mask=qmask, other=0).to(tl.int32)
                q = (q >> (2 * (k[None, :] % 4))) & 3
                if HIGH > 0:
                    above = tl.load(h_ptr + n[:, None] * stride_h + k[None, :] // 8, mask=qmask, other=0).to(tl.int32)
                    q |= ((above >> (k[None, :] % 8)) & 1) << 2
            else:
                q = tl.load(q_ptr + n[:, None] * stride_q + k[None, :], mask=qmask, other=0)
            w = (_e4m3(q) if FP8 else q.to(tl.float32)) * _scale(s_ptr, d_ptr, n, nmask, stride_s, stride_d, k0, K,
                                                                  BLOCK_K, GROUP, BLOCK_K, SUPERS)
            if HAS_LOW:
                w += _scale(l_ptr, dl_ptr, n, nmask, stride_s, stride_d, k0, K, BLOCK_K, GROUP, BLOCK_K, SUPERS)
            x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            acc += dot(x, tl.trans(w.to(x.dtype)), IEEE)
    tl.store(out_ptr + split * stride_split + m[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def block_k(bits: int, group: int) -> int | None:
    """The tile of inputs: within one group or a whole number of them (128, 64 or 32 inputs; 4 bits
    need 32, a half of 16 inputs for each nibble's tl.dot); None where no tile fits."""
    for size in (128, 64, 32, 16):
        if (group % size == 0 or size % group == 0) and (size >= 32 or bits != 4):
            return size
    return None


@functools.cache
def _programs(device: torch.device) -> int:
    """Programs enough to keep every SM reading: two a multiprocessor (4 interpreted on the CPU)."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def quant_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor | None, bits: int,
               group: int, fp8: bool = False, supers: tuple[torch.Tensor, torch.Tensor | None] | None = None,
               codebook: torch.Tensor | None = None, above: tuple[torch.Tensor, int, int] | None = None
               ) -> torch.Tensor:
    """x [..., K] times the weight q [N, K / 2] (4 bits: values, or indices into `codebook`), [N, K / 4]
    (2 bits) or [N, K] (8 bits; fp8: e4m3 codes viewed as uint8) with scales and lows [N, K / group]
    transposed -> [..., N] in x's dtype. Scales and lows are float32 or float16, or int8 with `supers`:
    float32 [N, K / 256] (d, and dl for the lows) they multiply. `above`: (plane [N, K * high / 8],
    high, offset): each 4-bit (2-bit) value's next `high` bits (one), the value then less `offset`."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    n = q.shape[0]
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    block_n, tile_k = 64, block_k(bits, group)
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, tile_k)
    # the split depends on the weight's shape alone, never on how many rows the batch holds
    splits = min(k_tiles, triton.cdiv(_programs(x.device), n_tiles)) if m <= SPLIT_ROWS else 1
    k_split = triton.cdiv(k_tiles, splits) * tile_k
    splits = triton.cdiv(k, k_split)
    out = torch.empty(splits, m, n, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), n_tiles, splits)
    d, dl = supers if supers is not None else (scales, None)
    plane, high, offset = above if above is not None else (q, 0, 0)
    _quant_gemm[grid](rows, q, plane, scales, scales if lows is None else lows, d, d if dl is None else dl,
                      q if codebook is None else codebook, out, m, n, k, k_split, rows.stride(0), q.stride(0),
                      plane.stride(0), scales.stride(0), d.stride(0), out.stride(1), out.stride(0), BITS=bits,
                      HIGH=high, OFFSET=offset, GROUP=group, HAS_LOW=lows is not None, SUPERS=supers is not None,
                      CODEBOOK=codebook is not None, FP8=fp8, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=tile_k)
    out = out[0] if splits == 1 else out.sum(0).to(x.dtype)
    return out.reshape(*x.shape[:-1], n)
