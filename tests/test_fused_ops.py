"""fused_ops.c (the eager steps' row-wise ops) against the torch reference's ops."""

from __future__ import annotations

import shutil

import pytest
import torch

from services.worker.backends.torch_cpu import fused_ops
from services.worker.backends.torch_cpu.ops import TORCH_OPS, TorchOps

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the ops with")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    built = fused_ops.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "fused_ops.c did not build"
    return built


def cos_sin(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float().unsqueeze(-1) / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch(fused, dtype):
    torch.manual_seed(0)
    x, residual = torch.randn(2, 7, 576).to(dtype), torch.randn(2, 7, 576).to(dtype)
    weight = torch.rand(576).to(dtype) + 0.5
    out, summed = fused.add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_summed = TORCH_OPS.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, expected_summed)  # one rounded add: the same bits
    torch.testing.assert_close(out, expected_out, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_rotary_matches_torch_on_the_projections_views(fused, dtype, head_dim):
    """q and k come as views into the fused qkv projection: rows strided, heads contiguous."""
    torch.manual_seed(1)
    num_heads, num_kv_heads, tokens = 6, 2, 9
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    cos, sin = cos_sin(torch.arange(tokens) * 37 + 5, head_dim)
    expected_q, expected_k = TORCH_OPS.rotary(q, k, cos, sin)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-6}
    torch.testing.assert_close(fused.rotate(q, cos, sin), expected_q, **tolerance)
    torch.testing.assert_close(fused.rotate(k, cos, sin), expected_k, **tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(fused, dtype):
    torch.manual_seed(2)
    gate_up = (torch.randn(5, 2 * 1536) * 6).to(dtype)  # gates out to where silu saturates
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-6}
    torch.testing.assert_close(fused.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up), **tolerance)


def test_a_row_gets_the_same_bits_whatever_its_batch(fused):
    """Every row is computed on its own, in or out of OpenMP's shares: alone or in a batch, identical."""
    torch.manual_seed(3)
    x, residual, weight = torch.randn(33, 576), torch.randn(33, 576), torch.rand(576)
    gate_up = torch.randn(33, 3072)
    batched_norm, batched_silu = fused.add_rms_norm(x, residual, weight, 1e-5)[0], fused.silu_and_mul(gate_up)
    for row in (0, 17, 32):
        assert torch.equal(fused.add_rms_norm(x[row : row + 1], residual[row : row + 1], weight, 1e-5)[0][0],
                           batched_norm[row])
        assert torch.equal(fused.silu_and_mul(gate_up[row : row + 1])[0], batched_silu[row])


def test_torch_ops_take_the_fused_ops_where_they_can(fused):
    """TorchOps hands float32/bfloat16 rows to the C ops; float16 stays on torch's."""
    torch.manual_seed(4)
    ops = TorchOps(fused=fused)
    gate_up, x, weight = torch.randn(3, 64), torch.randn(3, 32), torch.rand(32)
    assert torch.equal(ops.silu_and_mul(gate_up), fused.silu_and_mul(gate_up))
    assert torch.equal(ops.add_rms_norm(x, x, weight, 1e-6)[0], fused.add_rms_norm(x, x, weight, 1e-6)[0])
    half = gate_up.half()
    assert not fused.supports(half)
    assert torch.equal(ops.silu_and_mul(half), TORCH_OPS.silu_and_mul(half))


def test_no_compiler_means_no_fused_ops(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    assert fused_ops.load(tmp_path) is None


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-3), (torch.bfloat16, 1.0)])
def test_the_model_on_the_c_kernels_matches_torch_ops(default_model_path, hf_tokenizer, fused, dtype, atol):
    """The real model, prefill then decode steps of a ragged batch, on the C kernels (decode attention
    and row ops) against the reference ops. bfloat16: each runs its own summation order and
    rounding, so logits move by up to ~1 and a near tie may flip."""
    from services.worker.backends.torch_cpu import decode_kernel
    from services.worker.loader import load_model
    from tests.model_helpers import make_runner
    from tests.test_compiled import _decode_logits, _start
    from tests.test_llama_vs_hf import PROMPTS

    runners = [make_runner(load_model(default_model_path, dtype=dtype, ops=ops), 256, kv_dtype=dtype)
               for ops in (TorchOps(decode_kernel.load(), fused), TORCH_OPS)]
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
