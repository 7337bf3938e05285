"""fused_ops.c (the row-wise ops) against the torch reference's ops, in every variant this CPU runs."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.ops import NATIVE_OPS, TORCH_OPS

DTYPES = [torch.float32, torch.bfloat16]
ops = torch.ops.switchyard_cpu


def cos_sin(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float().unsqueeze(-1) / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch(variant, dtype):
    torch.manual_seed(0)
    x, residual = torch.randn(2, 7, 576).to(dtype), torch.randn(2, 7, 576).to(dtype)
    weight = torch.rand(576).to(dtype) + 0.5
    out, summed = ops.add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_summed = TORCH_OPS.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, expected_summed)  # one rounded add: the same bits
    torch.testing.assert_close(out, expected_out, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_rotary_matches_torch_on_the_projections_views(variant, dtype, head_dim):
    """q and k come as views into the fused qkv projection: rows strided, heads contiguous."""
    torch.manual_seed(1)
    num_heads, num_kv_heads, tokens = 6, 2, 9
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    cos, sin = cos_sin(torch.arange(tokens) * 37 + 5, head_dim)
    expected_q, expected_k = TORCH_OPS.rotary(q, k, cos, sin)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-6}
    torch.testing.assert_close(ops.rotary(q, cos, sin), expected_q, **tolerance)
    torch.testing.assert_close(ops.rotary(k, cos, sin), expected_k, **tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(variant, dtype):
    torch.manual_seed(2)
    gate_up = (torch.randn(5, 2 * 1536) * 6).to(dtype)  # gates out to where silu saturates
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-6}
    torch.testing.assert_close(ops.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up), **tolerance)


def test_a_row_gets_the_same_bits_whatever_its_batch(variant):
    """Every row is computed on its own, in or out of OpenMP's shares: alone or in a batch, identical."""
    torch.manual_seed(3)
    x, residual, weight = torch.randn(33, 576), torch.randn(33, 576), torch.rand(576)
    gate_up = torch.randn(33, 3072)
    batched_norm, batched_silu = ops.add_rms_norm(x, residual, weight, 1e-5)[0], ops.silu_and_mul(gate_up)
    for row in (0, 17, 32):
        assert torch.equal(ops.add_rms_norm(x[row : row + 1], residual[row : row + 1], weight, 1e-5)[0][0],
                           batched_norm[row])
        assert torch.equal(ops.silu_and_mul(gate_up[row : row + 1])[0], batched_silu[row])


def test_the_native_ops_take_the_c_kernels_where_they_can(cpu_kernels):
    """NATIVE_OPS hands float32/bfloat16 rows to the C ops; float16 stays on torch's."""
    torch.manual_seed(4)
    gate_up, x, weight = torch.randn(3, 64), torch.randn(3, 32), torch.rand(32)
    assert torch.equal(NATIVE_OPS.silu_and_mul(gate_up), ops.silu_and_mul(gate_up))
    assert torch.equal(NATIVE_OPS.add_rms_norm(x, x, weight, 1e-6)[0], ops.add_rms_norm(x, x, weight, 1e-6)[0])
    half = gate_up.half()
    assert torch.equal(NATIVE_OPS.silu_and_mul(half), TORCH_OPS.silu_and_mul(half))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-3), (torch.bfloat16, 1.0)])
def test_the_model_on_the_c_kernels_matches_torch_ops(default_model_path, hf_tokenizer, cpu_kernels, dtype, atol):
    """The real model, prefill then decode steps of a ragged batch, on the C kernels (decode attention
    and row ops) against the reference ops, both on dense weights. bfloat16: each runs its own
    summation order and rounding, so logits move by up to ~1 and a near tie may flip."""
    from services.worker.loader import load_model
    from tests.model_helpers import make_runner
    from tests.test_compiled import _decode_logits, _start
    from tests.test_llama_vs_hf import PROMPTS

    runners = [make_runner(load_model(default_model_path, dtype=dtype, ops=o), 256, kv_dtype=dtype)
               for o in (NATIVE_OPS, TORCH_OPS)]
    prompts = [hf_tokenizer.encode(PROMPTS[i % len(PROMPTS)])[: 3 + 11 * i] for i in range(5)]
    for runner in runners:
        _start(runner, prompts)
    tokens, agree = None, 0
    for _ in range(3):
        got, expected = (_decode_logits(runner, len(prompts), tokens).float() for runner in runners)
        torch.testing.assert_close(got, expected, atol=atol, rtol=0.05)
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        tokens = expected.argmax(-1).tolist()
    assert agree >= (15 if dtype == torch.float32 else 13)
