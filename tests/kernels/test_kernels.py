"""Every Triton kernel of the CUDA backend against the torch backend's op (the reference), on the
CPU under TRITON_INTERPRET=1 in float32 and float16 (the interpreter's bfloat16 tl.dot is wrong on
the CPU), and on a GPU, where there is one, in bfloat16 too. GQA ratios 1, 2 and 4, block sizes 16
and 32, random block tables, cached prefixes, lengths off the block grid, and decode and prefill
rows in one batch; the routed experts' grouped GEMMs."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.cuda.kernels.activation import silu_and_mul
from services.worker.backends.cuda.kernels.decode_attention import decode_attention
from services.worker.backends.cuda.kernels.experts import grouped_experts
from services.worker.backends.cuda.kernels.kv_write import write_kv
from services.worker.backends.cuda.kernels.norm import rms_norm
from services.worker.backends.cuda.kernels.prefill_attention import prefill_attention
from services.worker.backends.cuda.kernels.rotary import rotary
from services.worker.backends.torch_cpu import ops as torch_ops
from services.worker.backends.torch_cpu.attention import AttentionMetadata, paged_attention
from services.worker.backends.torch_cpu.attention import write_kv as torch_write_kv
from services.worker.backends.torch_cpu.experts import grouped_experts as torch_grouped_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# on a GPU float32 dots may run in TF32 in torch's reference; ours are IEEE
TOLERANCE = {torch.float32: dict(atol=2e-5 if DEVICE == "cpu" else 2e-3, rtol=1e-4 if DEVICE == "cpu" else 2e-3),
             torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def randn(*shape, dtype, generator=None) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_and_rms_norm(dtype):
    torch.manual_seed(0)
    x, residual, weight = randn(5, 96, dtype=dtype), randn(5, 96, dtype=dtype), randn(96, dtype=dtype)
    expected, expected_sum = torch_ops.TORCH_OPS.add_rms_norm(x, residual, weight, 1e-5)
    summed = residual.clone()
    got = rms_norm(x, weight, 1e-5, residual=summed)
    torch.testing.assert_close(summed, expected_sum, **TOLERANCE[dtype])
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), torch_ops.rms_norm(x, weight, 1e-5), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 48])  # 48 of 64: a partial rotary (Phi-4-mini's share)
def test_rotary_in_place(dtype, rotary_dim):
    torch.manual_seed(0)
    q, k = randn(7, 8, 64, dtype=dtype), randn(7, 2, 64, dtype=dtype)
    exponents = torch.arange(0, rotary_dim, 2).float() / rotary_dim
    freqs = torch.arange(7).float()[:, None] * (1.0 / 10000**exponents)
    emb = torch.cat([freqs, freqs], -1).to(DEVICE)
    cos, sin = emb.cos(), emb.sin()
    expected_q, expected_k = torch_ops.TORCH_OPS.rotary(q, k, cos, sin)
    got_q, got_k = rotary(q.clone(), k.clone(), cos, sin)
    torch.testing.assert_close(got_q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(got_k, expected_k, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(0)
    x = randn(3, 2 * 80, dtype=dtype) * 4
    torch.testing.assert_close(silu_and_mul(x), torch_ops.TORCH_OPS.silu_and_mul(x), **TOLERANCE[dtype])


def _batch(rows: list[tuple[int, int]], block_size: int, num_kv_heads: int, group: int, head_dim: int, dtype,
           seed: int):
    """rows: (num_cached, num_new) per sequence, num_new == 1 a decode row. Random pool contents,
    random (scattered) block tables, the null block last."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in rows) + 3
    shape = (num_blocks + 1, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = randn(*shape, dtype=dtype, generator=gen), randn(*shape, dtype=dtype, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for num_cached, num_new in rows:
        needed = -(-(num_cached + num_new) // block_size)
        table, order = order[:needed], order[needed:]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(num_cached, num_cached + num_new)]
    num_tokens = sum(n for _, n in rows)
    q = randn(num_tokens, num_kv_heads * group, head_dim, dtype=dtype, generator=gen)
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, generator=gen)
    v = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, generator=gen)
    return k_cache, v_cache, tables, torch.tensor(slots, device=DEVICE), q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,group", [(4, 1), (2, 2), (1, 4)])
# a sliding-window layer's window (off the block grid) with Gemma 2's soft cap (low: it bites)
@pytest.mark.parametrize("window,softcap", [(None, None), (20, 2.0)])
def test_kv_write_then_paged_attention_over_a_mixed_batch(dtype, block_size, num_kv_heads, group, window, softcap):
    _mixed_batch(dtype, block_size, num_kv_heads, group, window, softcap, images=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (20, 2.0)])
def test_prefill_attention_with_images_seen_both_ways(dtype, window, softcap):
    _mixed_batch(dtype, 16, 2, 2, window, softcap, images=True)


def _mixed_batch(dtype, block_size, num_kv_heads, group, window, softcap, images: bool) -> None:
    """Decode rows with short and long contexts, a fresh prefill, one after a cached prefix, a chunk
    whose start and end are off the block grid; images: spans of two prefills whose queries see each
    other both ways (Gemma 3's image tokens), one reaching its chunk's end. Against the torch backend's."""
    rows = [(0, 1), (37, 1), (0, 21), (2 * block_size, 9), (75, 1), (block_size + 5, 30), (130, 1)]
    k_cache, v_cache, tables, slots, q, k, v = _batch(rows, block_size, num_kv_heads, group, 32, dtype, seed=1)
    null = k_cache.shape[0] - 1
    scale = 32**-0.5

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_write_kv(ref_k, ref_v, k, v, slots)
    got_k, got_v = k_cache.clone(), v_cache.clone()
    padded = torch.cat([slots, torch.tensor([-1, -1], device=DEVICE)])  # padding slots are skipped
    write_kv(torch.cat([k, k[:2]]), torch.cat([v, v[:2]]), got_k, got_v, padded)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)

    # the reference: the torch backend's metadata and attention
    decode_rows, decode_tables, decode_lens, prefills, starts = [], [], [], [], []
    row = 0
    for (num_cached, num_new), table in zip(rows, tables, strict=True):
        if num_new == 1:
            decode_rows.append(row)
            decode_tables.append(table)
            decode_lens.append(num_cached + 1)
        else:
            prefills.append((row, num_new, num_cached, torch.tensor(table, device=DEVICE)))
        starts.append(row)
        row += num_new
    spans = {starts[2]: [(3, 12)], starts[5]: [(block_size + 8, block_size + 35)]} if images else {}
    limits = torch.full((row,), -1, dtype=torch.int32)
    for first, chunk_spans in spans.items():
        num_cached = next(c for (c, _), s in zip(rows, starts, strict=True) if s == first)
        for begin, end in chunk_spans:
            limits[first + begin - num_cached:first + end - num_cached] = end - 1
    width = max(len(t) for t in decode_tables)
    decode_table = torch.tensor([t + [null] * (width - len(t)) for t in decode_tables], device=DEVICE)
    mask = torch.arange(width * block_size, device=DEVICE)[None, :] < torch.tensor(decode_lens, device=DEVICE)[:, None]
    meta = AttentionMetadata(slot_mapping=slots, decode_token_idx=torch.tensor(decode_rows, device=DEVICE),
                             decode_block_tables=decode_table,
                             decode_context_mask=mask.view(len(decode_rows), 1, 1, -1),
                             decode_context_lens=torch.tensor(decode_lens, device=DEVICE), prefills=prefills,
                             bidirectional=spans)
    expected = paged_attention(q, ref_k, ref_v, meta, scale, window=window, softcap=softcap)

    def ints(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    out = torch.full_like(q, float("nan"))
    decode_attention(q, got_k, got_v, out, ints(decode_rows), decode_table.int(), ints(decode_lens), scale,
                     num_splits=3, window=window, softcap=softcap)
    width = max(len(p[3]) for p in prefills)
    prefill_tables = ints([p[3].tolist() + [null] * (width - len(p[3])) for p in prefills])
    prefill_attention(q, got_k, got_v, out, ints([p[0] for p in prefills]), ints([p[1] for p in prefills]),
                      ints([p[2] for p in prefills]), prefill_tables, max(p[1] for p in prefills), scale,
                      window=window, softcap=softcap, limits=limits.to(DEVICE) if images else None)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_split_kv_decode_gives_one_answer_however_it_splits(num_splits):
    rows = [(200, 1), (3, 1), (64, 1)]  # the short row leaves later splits empty
    k_cache, v_cache, tables, slots, q, k, v = _batch(rows, 16, 2, 4, 64, torch.float32, seed=2)
    null = k_cache.shape[0] - 1
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [null] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([c + 1 for c, _ in rows], dtype=torch.int32, device=DEVICE)
    outs = []
    for splits in (1, num_splits):
        out = torch.zeros_like(q)
        rows_ = torch.arange(3, dtype=torch.int32, device=DEVICE)
        decode_attention(q, k_cache, v_cache, out, rows_, table, lens, 0.125, num_splits=splits)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,width", [
    (1, 4, 2, 32, 48),  # one token: most tiles empty
    (37, 8, 2, 64, 96),  # Mixtral's routing; widths off the tile grid
    (20, 16, 8, 32, 32),  # Qwen3-MoE's top 8; some experts get no token
])
def test_grouped_expert_gemms_match_the_torch_experts(dtype, num_tokens, num_experts, top_k, hidden, width):
    gen = torch.Generator().manual_seed(num_tokens)
    x = randn(num_tokens, hidden, dtype=dtype, generator=gen)
    w13 = (randn(num_experts, 2 * width, hidden, dtype=torch.float32, generator=gen) * 0.2).to(dtype)
    w2 = (randn(num_experts, hidden, width, dtype=torch.float32, generator=gen) * 0.2).to(dtype)
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=gen), -1)
    weights, experts = torch.topk(probs, top_k, -1)
    weights, experts = weights.to(dtype=dtype, device=DEVICE), experts.to(DEVICE)
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, experts),
                               torch_grouped_experts(x, w13, w2, weights, experts), **TOLERANCE[dtype])
