"""decode_attention.c (the eager decode rows' attention) against the torch reference's matmuls."""

from __future__ import annotations

import shutil

import pytest
import torch

from services.worker.backends.torch_cpu import decode_kernel
from services.worker.backends.torch_cpu.attention import AttentionMetadata, _decode, paged_attention

BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the kernel with")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    built = decode_kernel.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "decode_attention.c did not build"
    return built


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
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (2, 4, 128), (4, 1, 64), (1, 6, 64)])
@pytest.mark.parametrize("block_size", [BLOCK_SIZE, 8, 32])
def test_the_kernel_matches_the_matmuls(kernel, dtype, num_kv_heads, group, head_dim, block_size):
    """Blocks of 16 keys and more take the AVX-512 tiles where the machine has them; blocks of 8
    the portable loops. Groups of 6 heads take two passes (4 + 2) over the blocks."""
    torch.manual_seed(0)
    q, k_cache, v_cache, meta = ragged_batch([1, 16, 17, 40, 300], num_kv_heads, group, head_dim, dtype, block_size)
    assert kernel.supports(q, k_cache)

    out = kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, head_dim**-0.5)

    expected = _decode(q, k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=0)


def test_a_sequence_gets_the_same_bits_whatever_its_batch(kernel):
    """Each (sequence, KV head) is computed on its own: alone or beside others, its row is identical."""
    torch.manual_seed(1)
    q, k_cache, v_cache, meta = ragged_batch([5, 200, 33, 129], 3, 3, 64, torch.float32)
    batched = kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.125)
    for row in range(len(q)):
        width = -(-int(meta.decode_context_lens[row]) // BLOCK_SIZE)
        alone = kernel(q[row : row + 1], k_cache, v_cache, meta.decode_block_tables[row : row + 1, :width],
                       meta.decode_context_lens[row : row + 1], 0.125)
        assert torch.equal(alone[0], batched[row])


def test_paged_attention_takes_the_kernel_where_it_can(kernel):
    """The eager decode rows go through the kernel when it is handed one; a dtype it was not built
    for (float16), a cache of another dtype or a head size it lacks stay on the matmuls."""
    torch.manual_seed(2)
    q, k_cache, v_cache, meta = ragged_batch([3, 50], 3, 3, 64, torch.float32)
    direct = kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.125)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125, kernel), direct)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125), _decode(q, k_cache, v_cache, meta, 0.125))

    half = q.half(), k_cache.half(), v_cache.half()
    assert not kernel.supports(half[0], half[1])
    assert torch.equal(paged_attention(*half, meta, 0.125, kernel), _decode(*half, meta, 0.125))
    assert not kernel.supports(q, k_cache.bfloat16())
    assert not kernel.supports(torch.zeros(1, 9, 96), torch.zeros(2, 3, BLOCK_SIZE, 96))


def test_no_compiler_means_no_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    assert decode_kernel.load(tmp_path) is None
