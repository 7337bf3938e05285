"""kv_write.cpp's write_kv_ against torch's index_put_ (attention.write_kv): the same caches, bit for bit."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.attention import write_kv

ops = torch.ops.switchyard_cpu


def projection_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """k and v as the model passes them: views into the fused qkv projection (rows strided)."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 200])  # past 64 tokens, on torch's threads
def test_write_kv_writes_what_index_put_writes(cpu_kernels, dtype, tokens):
    torch.manual_seed(0)
    num_blocks, kv_heads, block_size, head_dim = 40, 3, 16, 64
    k, v = projection_views(tokens, 9, kv_heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    expected_k = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    expected_v = torch.randn_like(expected_k)
    got_k, got_v = expected_k.clone(), expected_v.clone()
    write_kv(expected_k, expected_v, k, v, slots)
    ops.write_kv_(got_k, got_v, k, v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    # contiguous rows too (a backend that hands k and v over on their own)
    ops.write_kv_(got_k, got_v, k.contiguous() * 2, v.contiguous() * 2, slots)
    write_kv(expected_k, expected_v, k * 2, v * 2, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)


def test_write_kv_refuses_a_slot_outside_the_caches_and_writes_nothing(cpu_kernels):
    k_cache, v_cache = torch.zeros(4, 2, 16, 64), torch.zeros(4, 2, 16, 64)
    k, v = torch.ones(2, 2, 64), torch.ones(2, 2, 64)
    for slot in (64, -1):
        with pytest.raises(RuntimeError, match="is not one of the 64 slots"):
            ops.write_kv_(k_cache, v_cache, k, v, torch.tensor([3, slot]))
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(RuntimeError, match="k and v must be Float, got BFloat16"):
        ops.write_kv_(k_cache, v_cache, k.bfloat16(), v.bfloat16(), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="k and v must have shape"):
        ops.write_kv_(k_cache, v_cache, torch.ones(2, 3, 64), torch.ones(2, 3, 64), torch.tensor([0, 1]))
