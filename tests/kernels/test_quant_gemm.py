"""The CUDA backend's GEMM over a file's quantized weights (kernels/quant_gemm.py) against torch's
matmul on the same weights dequantized: AWQ/GPTQ/compressed-tensors groups of 32 to 128 with lows,
int8 with and without them, GPTQ's act-order, a GGUF's groups of 16; on the CPU under
TRITON_INTERPRET=1 in float32 and float16, on a GPU in bfloat16 too. Then a whole AWQ checkpoint
on the CUDA backend: the torch CPU backend's logits on the same integers."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.cuda.quant_linear import TritonQuantLinear
from services.worker.loader.quant_blocks import QuantBlocks
from tests.kernels.test_kernels import DEVICE, DTYPES, TOLERANCE


def _blocks(n: int, k: int, bits: int, group: int, low: bool, act_order: bool, gen) -> QuantBlocks:
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3).half().float()
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
    (8, 128, True, False, 256), (8, 16, False, False, 256), (8, 256, False, False, 512)])
def test_the_quantized_gemm_is_the_matmul_on_the_dequantized_weights(dtype, bits, group, low, act_order, k):
    """Tiles of 128 inputs over groups of 16-64 (352: a last tile cut short) or within groups of 128-256;
    up to 64 rows the inputs are split between programs (4 on the CPU), past it not."""
    gen = torch.Generator().manual_seed(bits * group)
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


def test_an_fp8_checkpoint_is_dequantized_on_the_cuda_backend_to_the_cpu_backends_logits(tmp_path, cpu_kernels):
    """FP8's codes stay codes on the CPU (quant_linear decodes them); the CUDA backend dequantizes them
    at load (kept_linears leaves them out): the same logits."""
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
    assert cuda.blocks and not cuda.unloaded  # the file's codes read, none kept
    quantize(cuda.model, cuda.blocks, cuda.unloaded).to(DEVICE)
    assert not any(isinstance(m, TritonQuantLinear) for m in cuda.model.modules())
    cpu = load_model(str(folder), ops=NATIVE_OPS, keep=kept_weights)
    cpu_quantize(cpu.model, "compressed-tensors", cpu.blocks, cpu.unloaded)
    assert cpu.model.layers[0].attention.wqkv.qweight.dtype == torch.float8_e4m3fn
    ids = [3, 17, 99, 4, 200, 31, 7, 7, 8, 120, 45, 2, 19]
    expected = prefill_logits(make_runner(cpu, num_blocks=8), ids)
    torch.testing.assert_close(prefill_logits(cuda_runner(cuda, 8), ids).cpu(), expected, atol=1e-4, rtol=1e-4)
