"""decode_attention.c (the decode rows' attention) against the torch reference's matmuls, in every
variant this CPU runs."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.attention import AttentionMetadata, _decode, paged_attention

BLOCK_SIZE = 16
# against the reference computed in float64: a float32 reference rounds as much as the kernel does, and
# differently on each CPU (Intel's, heads of 256: 1.55e-05 off float64, the kernel 5.7e-06)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def kernel(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0):
    return torch.ops.switchyard_cpu.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window,
                                                     softcap)


def ragged_batch(lengths, num_kv_heads, group, head_dim, dtype, block_size=BLOCK_SIZE):
    """Caches with scattered blocks, tables padded with block 0, queries: what the step would pass."""
    widths = [-(-n // block_size) for n in lengths]
    ids = (torch.randperm(sum(widths) + 3) + 1)[: sum(widths)].tolist()
    tables, start = [], 0
    for width in widths:
        tables.append(ids[start : start + width] + [0] * (max(widths) - width))
        start += width
    k_cache = torch.randn(sum(widths) + 4, num_kv_heads, block_size, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor(lengths)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long), decode_token_idx=torch.arange(len(lengths)),
        decode_block_tables=torch.tensor(tables), decode_context_lens=lens, prefills=[],
        decode_context_mask=(torch.arange(max(widths) * block_size) < lens.unsqueeze(1)).view(len(lengths), 1, 1, -1))
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim).to(dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (2, 4, 128), (4, 1, 64), (1, 72, 64), (2, 2, 256), (2, 3, 96)])
@pytest.mark.parametrize("block_size", [BLOCK_SIZE, 8, 32])
def test_the_kernel_matches_the_matmuls(variant, dtype, num_kv_heads, group, head_dim, block_size):
    """Blocks of 16 keys and more take the AVX-512 tiles in that variant; blocks of 8 the portable
    loops. A group of 72 heads takes two passes (64 + 8) over the blocks."""
    torch.manual_seed(0)
    q, k_cache, v_cache, meta = ragged_batch([1, 16, 17, 40, 300], num_kv_heads, group, head_dim, dtype, block_size)

    out = kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, head_dim**-0.5)

    expected = _decode(q.double(), k_cache.double(), v_cache.double(), meta, head_dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_a_sequence_gets_the_same_bits_whatever_its_batch(variant):
    """Each (sequence, KV head) is computed on its own: alone or beside others, its row is identical."""
    torch.manual_seed(1)
    q, k_cache, v_cache, meta = ragged_batch([5, 200, 33, 129], 3, 3, 64, torch.float32)
    batched = kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.125)
    for row in range(len(q)):
        width = -(-int(meta.decode_context_lens[row]) // BLOCK_SIZE)
        alone = kernel(q[row : row + 1], k_cache, v_cache, meta.decode_block_tables[row : row + 1, :width],
                       meta.decode_context_lens[row : row + 1], 0.125)
        assert torch.equal(alone[0], batched[row])


def test_paged_attention_takes_the_kernel_where_it_can(cpu_kernels):
    """The decode rows go through the kernel when `native`; a dtype it was not built for (float16),
    a cache of another dtype or a head size it lacks stay on the matmuls."""
    torch.manual_seed(2)
    q, k_cache, v_cache, meta = ragged_batch([3, 50], 3, 3, 64, torch.float32)
    direct = kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.125)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125, native=True), direct)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125), _decode(q, k_cache, v_cache, meta, 0.125))
    half = q.half(), k_cache.half(), v_cache.half()
    assert torch.equal(paged_attention(*half, meta, 0.125, native=True), _decode(*half, meta, 0.125))
    mixed = q, k_cache.bfloat16(), v_cache.bfloat16()
    assert torch.equal(paged_attention(*mixed, meta, 0.125, native=True), _decode(*mixed, meta, 0.125))


def test_tables_and_lengths_that_would_read_outside_the_cache_are_refused(cpu_kernels):
    """The op checks every block id a row reads and every length against its table before the
    kernel runs: a bad step raises, it never reads another sequence's memory or past the pool."""
    q, k_cache, v_cache, meta = ragged_batch([3, 50], 3, 3, 64, torch.float32)
    tables, lens = meta.decode_block_tables.clone(), meta.decode_context_lens.clone()
    for bad_tables, bad_lens, message in [
        (tables.masked_fill(tables == tables[1, 1], k_cache.shape[0]), lens, "is not one of the"),
        (tables.masked_fill(tables == tables[1, 0], -1), lens, "is not one of the"),
        (tables, lens + 100, "does not fit"),
        (tables, lens * 0, "does not fit"),
        (tables.int(), lens, "must be int64"),
        (tables[:1], lens, "block_tables must be"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            kernel(q, k_cache, v_cache, bad_tables, bad_lens, 0.125)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        kernel(q, k_cache.transpose(1, 2), v_cache, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be 64, 96, 128 or 256"):
        kernel(q[..., :32], k_cache[..., :32].contiguous(), v_cache[..., :32].contiguous(), tables, lens, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(300, None), (40, None), (1, None), (None, 5.0), (40, 5.0)])
@pytest.mark.parametrize("block_size", [BLOCK_SIZE, 8])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_a_windowed_or_capped_layer_on_the_native_path(variant, dtype, window, softcap, block_size, head_dim):
    """paged_attention(native=True) for a sliding-window layer (a window past every context, within
    some, of one key) or a soft-capped one (Gemma 2): the kernel, within the tolerance of the
    reference's masked matmuls."""
    torch.manual_seed(2)
    q, k_cache, v_cache, meta = ragged_batch([1, 16, 17, 40, 300], 3, 3, head_dim, dtype, block_size)
    q = q * 3  # scores of several units: the cap bends them
    got = paged_attention(q, k_cache, v_cache, meta, 0.125, native=True, window=window, softcap=softcap)
    assert torch.equal(got, kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.125,
                                   window or 0, softcap or 0.0))
    expected = _decode(q.double(), k_cache.double(), v_cache.double(), meta, 0.125, window, softcap)
    torch.testing.assert_close(got.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
