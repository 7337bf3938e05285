"""quant_dot.c (--quant-activations int8) on every 4-, 5- and 6-bit format, in every variant this CPU
runs: the rows quantized as llama.cpp does (here in torch: per 256 inputs, Q8_K's, for a k-quant,
per 32, Q8_0's, else), times gguf's dequantized weights in float64, is the oracle; a row's bits do
not depend on its batch, and every variant, the portable one included, gives the same bits (integer
sums, then the same float steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from services.worker.backends.torch_cpu.quantization import QuantLinear, int8_activations
from services.worker.loader.gguf_blocks import decode
from services.worker.loader.quant_blocks import QuantBlocks
from tests.test_gguf_kquants import HALF_AT, ROWS, int8_rows, outputs_in_every_variant, random_raw


def int4_checkpoint(n: int, k: int, group: int, generator: torch.Generator) -> QuantBlocks:
    """AWQ / GPTQ's form: 4-bit values in groups of 64 or 128, float32 scales and lows (-zero * scale)."""
    scale = torch.rand(n, k // group, generator=generator) * 0.02 + 1e-3
    zero = torch.randint(0, 16, (n, k // group), generator=generator).float()
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    return QuantBlocks(q, scale, -zero * scale, 4, group, torch.float32)


CASES = ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "Q4_1", "int4 g64", "int4 g128"]


def layer_and_weights(case: str, n: int, k: int) -> tuple[QuantLinear, torch.Tensor]:
    if case.startswith("int4"):
        blocks = int4_checkpoint(n, k, int(case.split("g")[1]), torch.Generator().manual_seed(n))
        return QuantLinear(blocks, None), blocks.dequantized
    raw = random_raw(case, n, k, np.random.default_rng(len(case)))
    weights = torch.from_numpy(dequantize(raw, GGMLQuantizationType[case]).reshape(n, k))
    return QuantLinear(decode(case, raw), None), weights


@pytest.mark.parametrize("case", CASES)
def test_int8_rows_match_the_quantized_rows_matmul_in_every_variant(cpu_kernels, case):
    n, k = 48, 512  # three panels, two super-blocks
    layer, weights = layer_and_weights(case, n, k)
    stored = layer.blocks
    assert int8_activations(layer) == 1 and layer.int8_activations
    assert torch.equal(layer.blocks.q, stored.q)  # the bytes in quant_dot.c's order hold the same values
    assert not torch.equal(layer.qweight, QuantLinear(stored, None).qweight)  # ... in another order
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3))
    assert layer.row_block == (256 if case.endswith("_K") else 32)
    expected = int8_rows(x, layer.row_block).double() @ weights.double().t()
    float_rows = x.double() @ weights.double().t()
    outputs = outputs_in_every_variant(layer, x, expected)
    assert all(torch.equal(out, outputs["portable"]) for out in outputs.values())
    # the rows really are int8: further from the float rows' product than the tolerance above
    assert (outputs["portable"].double() - float_rows).abs().max() > 1e-3 * float(float_rows.abs().max())


@pytest.mark.parametrize("case", ["Q4_K", "Q5_K", "Q6_K", "Q4_1", "int4 g64"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_values_times_the_largest_activations_stay_exact(cpu_kernels, case, sign):
    """Every stored value at its top (15, 31 or 63) and every activation +-127: maddubs's int16 pair
    sums (and any int16 sums a kernel holds before widening them) at their largest, still exact."""
    n, k = 32, 512
    if case.startswith("int4"):
        blocks = int4_checkpoint(n, k, 64, torch.Generator().manual_seed(1))
        blocks.q.fill_(15)
        layer, weights = QuantLinear(blocks, None), blocks.dequantized
    else:
        raw = random_raw(case, n, k, np.random.default_rng(5))
        size = raw.shape[1] // (k // 256 if case.endswith("_K") else k // 32)
        halves = np.zeros(size, dtype=bool)
        for at in HALF_AT[case]:
            halves[at:at + 2] = True
        cells = raw.reshape(n, -1, size)
        assert np.shares_memory(cells, raw)  # so the blocks themselves change
        cells[..., ~halves] = 0xFF  # every value, high bit and (Q6_K: -1) scale at its top
        weights = torch.from_numpy(dequantize(raw, GGMLQuantizationType[case]).reshape(n, k))
        layer = QuantLinear(decode(case, raw), None)
    assert int8_activations(layer) == 1
    x = torch.full((max(ROWS), k), sign)
    expected = int8_rows(x, layer.row_block).double() @ weights.double().t()
    outputs = outputs_in_every_variant(layer, x, expected)
    assert all(torch.equal(out, outputs["portable"]) for out in outputs.values())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_q6_k_super_blocks_at_their_largest_stay_exact(cpu_kernels, sign):
    """A k-quant's groups' sums times their int8 scales, added in int32 over the super-block before one
    float step (quant_dot.c): Q6_K with every value at -32, every scale at -128, every activation
    +-127, so each super-block's total is +-16 * 16 * 32 * 127 * 128 = 133,169,152 (< 2^27; 127 * 2^20:
    exact as a float). Every variant gives the bits of that float step done in order,
    acc = fma(total, super * d, acc)."""
    n, k = 32, 512
    raw = random_raw("Q6_K", n, k, np.random.default_rng(7))
    cells = raw.reshape(n, -1, 210)
    cells[..., :192] = 0x00  # the low nibbles and high bits: every value 0 - 32
    cells[..., 192:208] = 0x80  # every group's scale -128 (the float16 super at 208 kept)
    layer = QuantLinear(decode("Q6_K", raw), None)
    assert int8_activations(layer) == 1 and layer.row_block == 256
    x = torch.full((max(ROWS), k), sign)
    weights = torch.from_numpy(dequantize(raw, GGMLQuantizationType["Q6_K"]).reshape(n, k))
    outputs = outputs_in_every_variant(layer, x, int8_rows(x, 256).double() @ weights.double().t())
    total = 16 * 16 * (-32) * (127 * sign) * (-128)
    d = np.float32(1.0) / np.float32(127.0)  # the row's scale: max |x| / 127
    supers = layer.blocks.supers[..., 0].numpy().astype(np.float32)  # [n, k / 256]
    want = np.zeros(n, dtype=np.float32)
    for block in range(k // 256):  # fma: the 51-bit product exact in float64, its sum with acc rounded once, then to float32
        want = (total * (supers[:, block] * d).astype(np.float64) + want).astype(np.float32)
    for out in outputs.values():
        assert torch.equal(out, torch.from_numpy(want).expand_as(out))


def test_rows_round_their_halves_to_even_in_every_variant(cpu_kernels):
    """A row's x * 127 / max|x| exactly halfway between two integers: rounded to the even one (lrintf's
    rint in the portable variant, cvtps in the vector ones, torch.round in the oracle) in every variant."""
    n, k = 32, 256
    raw = random_raw("Q4_K", n, k, np.random.default_rng(9))
    weights = torch.from_numpy(dequantize(raw, GGMLQuantizationType["Q4_K"]).reshape(n, k))
    layer = QuantLinear(decode("Q4_K", raw), None)
    assert int8_activations(layer) == 1
    x = torch.arange(-15.5, 16.0).repeat(max(ROWS), k // 32)  # each block -15.5, -14.5 .. 15.5
    x[:, ::32] = 127.0  # ... its first the largest: the scale is 1, so the halves stay halves
    x[1::2] *= -1
    rows = int8_rows(x, layer.row_block)  # per 256 inputs (Q4_K): the scale still 1
    assert torch.equal(rows[0, 1:5], torch.tensor([-14.0, -14.0, -12.0, -12.0]))
    outputs = outputs_in_every_variant(layer, x, rows.double() @ weights.double().t())
    assert all(torch.equal(out, outputs["portable"]) for out in outputs.values())


def test_formats_without_an_int8_form_keep_float_rows(cpu_kernels):
    """IQ4's codebook indices and 8-bit values: int8_activations() leaves them, so their rows stay float32."""
    for kind in ("IQ4_XS", "Q8_0"):
        raw = random_raw(kind, 32, 256, np.random.default_rng(1))
        layer = QuantLinear(decode(kind, raw), None)
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
        before = layer(x)
        assert int8_activations(layer) == 0 and not layer.int8_activations
        with pytest.raises(ValueError, match="no int8-activation kernel"):
            layer.use_int8_rows()
        assert torch.equal(layer(x), before)
        layer.int8_activations = True  # asked for all the same: refused by name, never computed in float
        with pytest.raises(RuntimeError, match="no int8-activation kernel for 4-bit codebook indices|8 bits"):
            layer(x)
