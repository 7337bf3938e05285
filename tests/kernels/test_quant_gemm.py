"""The CUDA backend's GEMM over a file's quantized weights (kernels/quant_gemm.py) against torch's
matmul on the same weights dequantized: AWQ/GPTQ/compressed-tensors groups of 32 to 128 with lows,
int8 with and without them, FP8's e4m3 codes (every one but NaN), GPTQ's act-order, a GGUF's groups
of 16; on the CPU under TRITON_INTERPRET=1 in float32 and float16, on a GPU in bfloat16 too. Then
whole AWQ and FP8 checkpoints on the CUDA backend: the torch CPU backend's logits on the same codes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from services.worker.backends.cuda.quant_linear import TritonQuantLinear
from services.worker.loader.gguf_blocks import decode
from services.worker.loader.gguf_kquants import DECODERS
from services.worker.loader.quant_blocks import QuantBlocks
from tests.kernels.test_kernels import DEVICE, DTYPES, TOLERANCE
from tests.test_gguf_kquants import random_raw


def _blocks(n: int, k: int, bits: int, group: int, low: bool, act_order: bool, gen) -> QuantBlocks:
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3).half().float()
    if bits == "fp8":  # every e4m3 code (subnormals, both zeros) but the two NaNs, shuffled
        codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
        q = codes[torch.randint(0, len(codes), (n, k), generator=gen)].view(torch.float8_e4m3fn)
        return QuantBlocks(q, scale * 1e-2, None, 8, group, torch.float32)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        lows = -torch.randint(0, 16, scale.shape, generator=gen).float() * scale
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        lows = (torch.randint(-8, 8, scale.shape, generator=gen).float() * scale) if low else None
    perm = torch.randperm(k, generator=gen) if act_order else None
    return QuantBlocks(q, scale, lows, bits, group, torch.float32, perm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bits", "group", "low", "act_order", "k"), [
    (4, 128, True, False, 256), (4, 64, True, True, 256), (4, 32, True, False, 352), (4, 16, True, False, 256),
    (8, 128, True, False, 256), (8, 16, False, False, 256), (8, 256, False, False, 512),
    ("fp8", 128, False, False, 256), ("fp8", 32, False, False, 352)])
def test_the_quantized_gemm_is_the_matmul_on_the_dequantized_weights(dtype, bits, group, low, act_order, k):
    """Tiles of 128 inputs over groups of 16-64 (352: a last tile cut short) or within groups of 128-256;
    up to 64 rows the inputs are split between programs (4 on the CPU), past it not."""
    gen = torch.Generator().manual_seed({4: 4, 8: 8, "fp8": 9}[bits] * group)
    n = 96  # a tile of 64 outputs and a part of one
    blocks = _blocks(n, k, bits, group, low, act_order, gen)
    bias = torch.randn(n, generator=gen)
    layer = TritonQuantLinear(blocks, bias).to(DEVICE)
    assert torch.equal(layer.dequantized, blocks.dequantized)  # the layout round-trips
    for m in (1, 3, 40, 70):
        x = torch.randn(m, k, generator=gen).to(dtype)
        expected = (x.float() @ blocks.dequantized.to(dtype).float().T + bias).to(dtype)
        got = layer(x.to(DEVICE))
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float().cpu(), expected.float(),
                                   **(TOLERANCE[dtype] | ({"atol": 1e-4} if dtype == torch.float32 else {})))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_every_gguf_type_on_the_gemm_is_the_matmul_on_ggufs_dequantization(dtype, kind):
    """Each block type as the CUDA backend keeps it (a k-quant's int8 scales and its float32 d and dmin
    as the file has them; Q5_K's, Q6_K's and Q3_K's bits above their nibbles or pairs in a plane, Q2_K's
    four to a byte; IQ4's indices looked up): the weights gguf's own dequantization gives, to the bit,
    and the matmul on them."""
    rng = np.random.default_rng(7)
    raw = random_raw(kind, 80, 512, rng, scale=1e-3)
    weights = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]))
    layer = TritonQuantLinear(decode(kind, raw), None).to(DEVICE)
    assert torch.equal(layer.dequantized, weights)
    gen = torch.Generator().manual_seed(1)
    for m in (1, 70):
        x = torch.randn(m, 512, generator=gen).to(dtype)
        expected = (x.float() @ weights.to(dtype).float().T).to(dtype)
        torch.testing.assert_close(layer(x.to(DEVICE)).float().cpu(), expected.float(),
                                   **(TOLERANCE[dtype] | ({"atol": 1e-4} if dtype == torch.float32 else {})))


def test_every_fp8_code_is_torchs_e4m3_value():
    """The kernel's integer decoding of e4m3 (kernels/quant_gemm.py's _e4m3) against torch's cast, code by
    code: identity rows pick each weight out alone, in IEEE float32 (no other product in its sum)."""
    codes = [c for c in range(256) if c & 0x7F != 0x7F] + [0x00, 0x80]  # all but the two NaNs; both zeros again
    q = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).repeat(8, 1)  # [8, 256]
    layer = TritonQuantLinear(QuantBlocks(q, torch.ones(8, 2), None, 8, 128, torch.float32), None).to(DEVICE)
    assert torch.equal(layer(torch.eye(256, device=DEVICE)).cpu(), q.float().T)


@pytest.mark.slow  # a whole model's forward, interpreted
def test_an_awq_checkpoint_on_the_cuda_backend_keeps_its_integers_and_the_cpu_backends_logits(tmp_path, cpu_kernels):
    from services.worker.backends.cuda.ops import TritonOps
    from services.worker.backends.cuda.quant_linear import kept_linears, quantize
    from services.worker.backends.torch_cpu.ops import NATIVE_OPS
    from services.worker.backends.torch_cpu.quantization import kept_weights
    from services.worker.backends.torch_cpu.quantization import quantize as cpu_quantize
    from services.worker.loader import load_model
    from tests import quant_checkpoints as qc
    from tests.kernels.test_cuda_backend import DEVICE, cuda_runner
    from tests.model_helpers import make_runner, prefill_logits

    folder = qc.awq(qc.tiny_llama(), tmp_path / "awq")
    cuda = load_model(str(folder), ops=TritonOps(), keep=kept_linears, device=DEVICE)
    quantize(cuda.model, cuda.blocks, cuda.unloaded).to(DEVICE)
    linears = [m for n, m in cuda.model.named_modules() if n.startswith("layers.") and hasattr(m, "qweight")]
    assert len(linears) == 2 * 4 and all(isinstance(m, TritonQuantLinear) for m in linears)  # wqkv wo w13 w2
    cpu = load_model(str(folder), ops=NATIVE_OPS, keep=kept_weights)
    cpu_quantize(cpu.model, "awq", cpu.blocks, cpu.unloaded)
    ids = [3, 17, 99, 4, 200, 31, 7, 7, 8, 120, 45, 2, 19]
    expected = prefill_logits(make_runner(cpu, num_blocks=8), ids)
    got = prefill_logits(cuda_runner(cuda, 8), ids)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_an_fp8_checkpoint_on_the_cuda_backend_keeps_its_codes_and_the_cpu_backends_logits(tmp_path, cpu_kernels):
    """FP8's e4m3 codes stay codes on both backends (a byte a weight; the CPU's quant_linear and the
    Triton GEMM each decode them as they read): the same logits."""
    from services.worker.backends.cuda.ops import TritonOps
    from services.worker.backends.cuda.quant_linear import kept_linears, quantize
    from services.worker.backends.torch_cpu.ops import NATIVE_OPS
    from services.worker.backends.torch_cpu.quantization import kept_weights
    from services.worker.backends.torch_cpu.quantization import quantize as cpu_quantize
    from services.worker.loader import load_model
    from tests import quant_checkpoints as qc
    from tests.kernels.test_cuda_backend import DEVICE, cuda_runner
    from tests.model_helpers import make_runner, prefill_logits

    folder = qc.compressed_tensors(qc.tiny_llama(), tmp_path / "fp8", "fp8")
    cuda = load_model(str(folder), ops=TritonOps(), keep=kept_linears, device=DEVICE)
    quantize(cuda.model, cuda.blocks, cuda.unloaded).to(DEVICE)
    linears = [m for n, m in cuda.model.named_modules() if n.startswith("layers.") and hasattr(m, "qweight")]
    assert len(linears) == 2 * 4 and all(m.fp8 and m.qweight.dtype == torch.uint8 for m in linears)
    cpu = load_model(str(folder), ops=NATIVE_OPS, keep=kept_weights)
    cpu_quantize(cpu.model, "compressed-tensors", cpu.blocks, cpu.unloaded)
    assert cpu.model.layers[0].attention.wqkv.qweight.dtype == torch.float8_e4m3fn
    ids = [3, 17, 99, 4, 200, 31, 7, 7, 8, 120, 45, 2, 19]
    expected = prefill_logits(make_runner(cpu, num_blocks=8), ids)
    torch.testing.assert_close(prefill_logits(cuda_runner(cuda, 8), ids).cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # a whole model's forward, interpreted
def test_a_gguf_of_mixed_blocks_on_the_cuda_backend_keeps_them_and_transformers_logits(tmp_path, monkeypatch):
    """llama.cpp's types side by side (tests/test_gguf_kquants.py's mixed Llama: Q4_K, Q6_K, Q5_K, Q3_K,
    Q2_K, IQ4_XS, IQ4_NL, Q8_0, Q4_1) kept on the CUDA backend, as `--quantization auto` picks there:
    every Linear on the GEMM and the embedding table in its blocks (QuantEmbedding), in under 1.1x the
    bytes of the file's blocks, and transformers' logits on the same weights within float32's rounding."""
    from gguf import GGMLQuantizationType, GGUFReader

    from services.worker.backends.cuda.ops import TritonOps
    from services.worker.backends.cuda.quant_linear import TritonQuantParts, kept_linears, quantize
    from services.worker.backends.quant_embedding import QuantEmbedding
    from services.worker.backends.spec import weight_bytes
    from services.worker.loader import load_model
    from shared.engine_defaults import own_quantization
    from tests.kernels.test_cuda_backend import DEVICE, cuda_runner
    from tests.model_helpers import prefill_logits
    from tests.test_gguf_kquants import mixed_llama

    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path / "cache"))
    hf, path, _ = mixed_llama(tmp_path)
    assert own_quantization(path, "auto") == "gguf" and own_quantization(path, "dummy") is None
    cuda = load_model(path, ops=TritonOps(), keep=kept_linears, device=DEVICE)
    quantize(cuda.model, cuda.blocks, cuda.unloaded).to(DEVICE)
    assert not any(isinstance(m, torch.nn.Linear | torch.nn.Embedding) for m in cuda.model.modules())  # the head too
    assert isinstance(cuda.model.layers[0].attention.wqkv, TritonQuantParts)  # Q4_K's q and k, Q6_K's v
    ids = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = prefill_logits(cuda_runner(cuda, 16), ids).cpu()
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5 * float(theirs.abs().max()))
    blocks = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.tensor_type != GGMLQuantizationType.F32)
    kept = sum(weight_bytes(m) for m in cuda.model.modules() if isinstance(m, TritonQuantLinear | QuantEmbedding))
    assert kept < 1.1 * blocks, kept / blocks  # 1.03x
