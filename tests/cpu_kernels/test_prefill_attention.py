"""prefill_attention (decode_attention.c): a prefill chunk's rows, each the bits its token's decode
gives, whatever chunk or cached prefix it comes with, with or without a sliding window and a soft cap;
and close to the torch reference's SDPA and matmuls."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.attention import AttentionMetadata, _prefill, paged_attention

# against the reference computed in float64: a float32 reference rounds as much as the kernel does, and
# differently on each CPU (Intel's, heads of 256: 1.55e-05 off float64, the kernel 5.7e-06)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def kernel(q, k_cache, v_cache, block_ids, num_cached, scale, window=0, softcap=0.0):
    return torch.ops.switchyard_cpu.prefill_attention(q, k_cache, v_cache, block_ids, num_cached, scale, window,
                                                      softcap)


def sequence(context: int, num_kv_heads: int, head_dim: int, dtype, block_size: int = 16):
    """Caches holding one sequence's `context` keys in scattered blocks (a spare block or two around them)."""
    num_blocks = -(-context // block_size)
    k_cache = torch.randn(num_blocks + 3, num_kv_heads, block_size, head_dim).to(dtype)
    return k_cache, torch.randn_like(k_cache), torch.randperm(num_blocks + 3)[:num_blocks]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (2, 4, 128), (4, 1, 64), (1, 72, 64), (2, 2, 256), (2, 3, 96)])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("num_cached,num_query", [(0, 37), (5, 40), (100, 3), (33, 130)])
def test_each_row_is_its_decode(variant, dtype, num_kv_heads, group, head_dim, block_size, num_cached, num_query):
    """Row i is decode_attention's answer for a sequence of num_cached + i + 1 keys, to the bit: the
    rows share each key tile's loads (AVX-512, blocks of 16 keys and more: up to 64 queries a pass,
    so a row's group of 72 heads takes two) but each sums its own keys in a decode's order. Blocks
    of 8 take the portable loops, row by row."""
    torch.manual_seed(0)
    k_cache, v_cache, ids = sequence(num_cached + num_query, num_kv_heads, head_dim, dtype, block_size)
    q = torch.randn(num_query, num_kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5

    out = kernel(q, k_cache, v_cache, ids, num_cached, scale)

    lens = torch.arange(num_cached + 1, num_cached + num_query + 1)
    decoded = torch.ops.switchyard_cpu.decode_attention(q, k_cache, v_cache, ids.expand(num_query, -1).contiguous(),
                                                        lens, scale)
    assert torch.equal(out, decoded)
    expected = _prefill(q.double(), k_cache.double(), v_cache.double(), num_cached, ids, scale)  # causal SDPA
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(24, 0.0), (1, 0.0), (0, 30.0), (40, 2.0)])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("num_cached,num_query", [(0, 37), (50, 20), (3, 130)])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_a_windowed_or_capped_row_is_its_decode(variant, dtype, window, softcap, block_size, num_cached, num_query,
                                                head_dim):
    """A sliding window (row i sees its last `window` keys; a window of 1, itself alone) and a soft cap
    (Gemma 2's cap * tanh(score / cap)): each row still its decode's bits, and within the tolerance of
    the reference's masked SDPA or capped matmuls."""
    torch.manual_seed(3)
    k_cache, v_cache, ids = sequence(num_cached + num_query, 2, head_dim, dtype, block_size)
    q = (torch.randn(num_query, 6, head_dim) * 3).to(dtype)  # scores of several units: the cap bends them

    out = kernel(q, k_cache, v_cache, ids, num_cached, 0.125, window, softcap)

    lens = torch.arange(num_cached + 1, num_cached + num_query + 1)
    decoded = torch.ops.switchyard_cpu.decode_attention(q, k_cache, v_cache, ids.expand(num_query, -1).contiguous(),
                                                        lens, 0.125, window, softcap)
    assert torch.equal(out, decoded)
    expected = _prefill(q.double(), k_cache.double(), v_cache.double(), num_cached, ids, 0.125, window or None,
                        softcap or None)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_row_is_the_same_whatever_chunk_it_comes_in(variant):
    """A prompt of 150 tokens prefilled at once, or in three chunks (each after the keys before it, as a
    chunked prefill or a prefix-cache hit runs): the same bits in every row."""
    torch.manual_seed(1)
    k_cache, v_cache, ids = sequence(150, 3, 64, torch.float32)
    q = torch.randn(150, 9, 64)
    whole = kernel(q, k_cache, v_cache, ids, 0, 0.125)
    chunks = [kernel(q[a:b], k_cache, v_cache, ids, a, 0.125) for a, b in ((0, 37), (37, 128), (128, 150))]
    assert torch.equal(torch.cat(chunks), whole)


def test_paged_attention_takes_the_kernel_for_prefills_where_it_can(cpu_kernels):
    """With `native`, a prefill chunk goes through the kernel, a sliding window's and a soft cap's too; a
    dtype it was not built for (float16) or an image's two-way span stay on the reference's SDPA and matmuls."""
    torch.manual_seed(2)
    k_cache, v_cache, ids = sequence(60, 3, 64, torch.float32)
    q = torch.randn(20, 9, 64)
    meta = AttentionMetadata(slot_mapping=torch.zeros(20, dtype=torch.long), decode_token_idx=torch.zeros(0, dtype=torch.long),
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
                             decode_context_mask=torch.zeros(0, 1, 1, 16, dtype=torch.bool),
                             decode_context_lens=torch.zeros(0, dtype=torch.long), prefills=[(0, 20, 40, ids)])
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125, native=True), kernel(q, k_cache, v_cache, ids, 40, 0.125))
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125), _prefill(q, k_cache, v_cache, 40, ids, 0.125))
    half = q.half(), k_cache.half(), v_cache.half()
    assert torch.equal(paged_attention(*half, meta, 0.125, native=True), _prefill(*half, 40, ids, 0.125))
    for window, softcap in ((16, None), (None, 30.0)):
        assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125, native=True, window=window, softcap=softcap),
                           kernel(q, k_cache, v_cache, ids, 40, 0.125, window or 0, softcap or 0.0))
    meta.bidirectional = {0: [(42, 50)]}
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125, native=True),
                       _prefill(q, k_cache, v_cache, 40, ids, 0.125, spans=[(42, 50)]))


def test_block_ids_that_would_read_outside_the_cache_are_refused(cpu_kernels):
    """The op checks every block a row reads before the kernel runs: a bad step raises."""
    k_cache, v_cache, ids = sequence(50, 3, 64, torch.float32)
    q = torch.randn(10, 9, 64)
    for bad_ids, num_cached, message in [
        (ids.masked_fill(ids == ids[1], k_cache.shape[0]), 40, "is not one of the"),
        (ids.masked_fill(ids == ids[0], -1), 40, "is not one of the"),
        (ids, 60, "do not fit"),
        (ids, -1, "do not fit"),
        (ids.int(), 40, "must be \\[blocks\\] int64"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            kernel(q, k_cache, v_cache, bad_ids, num_cached, 0.125)
    for window, softcap, message in [(-1, 0.0, "window must be"), (0, -1.0, "softcap must be"),
                                     (0, float("inf"), "softcap must be")]:
        with pytest.raises(RuntimeError, match=message):
            kernel(q, k_cache, v_cache, ids, 40, 0.125, window, softcap)
