"""Write a step's K/V into the paged pool through the slot mapping; a slot of -1 (padding) is skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_scale, v_scale,
              stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ch, stride_ct,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        mask = d < HEAD_DIM
        k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
        dst = (slot // BLOCK_SIZE) * stride_cb + head * stride_ch + (slot % BLOCK_SIZE) * stride_ct + d
        if IS_FP8:  # stored divided by the layer's scale, read back multiplied by it
            k = k.to(tl.float32) / k_scale
            v = v.to(tl.float32) / v_scale
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, kv_heads, d]; caches: [blocks, kv_heads, block_size, d]; slot_mapping: [T] int."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _kv_write[(num_tokens, num_heads)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[2],
        IS_FP8=k_cache.dtype == torch.float8_e4m3fn)
