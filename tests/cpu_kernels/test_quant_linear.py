"""quant_linear.c against torch's matmul on the same weights, in every variant this CPU runs: each
output one float32 sum in order, so a row's bits do not depend on how many rows come with it, and
the variants with an FMA agree to the bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.worker.backends.torch_cpu.quantization import QuantLinear
from services.worker.loader.quant_blocks import QuantBlocks

# m: 1-4 (4 panels a block), up to 12 (2 panels, weights decoded in registers), more (a buffer of
# decoded weights per 128 inputs, blocks of 12 rows); n: 48 has a panel past the last pair; k: 96
# ends inside the first buffer, 1536 fills twelve
ROWS = [1, 2, 3, 4, 5, 12, 13, 40]
SHAPES = [(48, 96), (64, 1536), (576, 576)]


def random_blocks(n: int, k: int, bits: int, generator: torch.Generator) -> QuantBlocks:
    scale = (torch.rand(n, k // 32, generator=generator) * 0.02 + 1e-3).half().float()
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
        return QuantBlocks(q, scale, (-8 * scale).half().float())
    return QuantBlocks(torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8), scale, None)


def reference(x: torch.Tensor, blocks: QuantBlocks, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ blocks.dequantized.double().t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_the_matmul_and_a_row_is_the_same_at_every_batch(variant, bits, n, k):
    generator = torch.Generator().manual_seed(n + k + bits)
    blocks = random_blocks(n, k, bits, generator)
    bias = torch.randn(n, generator=generator)
    layer = QuantLinear(blocks, bias)
    assert torch.equal(layer.dequantized, blocks.dequantized)  # the layout round-trips
    x = torch.randn(max(ROWS), k, generator=generator)
    alone = layer(x[:1])
    for m in ROWS:
        out = layer(x[:m])
        assert out.shape == (m, n) and out.dtype == torch.float32
        expected = reference(x[:m], blocks, bias)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
        assert torch.equal(out[0], alone[0])  # the first row, whatever came with it


@pytest.mark.parametrize("bits", [4, 8])
def test_the_fma_variants_agree_to_the_bit(cpu_kernels, bits):
    runnable = [v for v in torch.ops.switchyard_cpu.variants() if v != "portable"]
    if len(runnable) < 2:
        pytest.skip("one variant with an FMA runs here")
    generator = torch.Generator().manual_seed(7)
    layer = QuantLinear(random_blocks(576, 1536, bits, generator), None)
    x = torch.randn(13, 1536, generator=generator)
    previous = torch.ops.switchyard_cpu.variant()
    try:
        outputs = []
        for name in runnable:
            torch.ops.switchyard_cpu.use_variant(name)
            outputs.append(layer(x))
    finally:
        torch.ops.switchyard_cpu.use_variant(previous)
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def test_bfloat16_rows_are_widened_and_the_outputs_rounded_back(cpu_kernels):
    generator = torch.Generator().manual_seed(3)
    blocks = random_blocks(64, 96, 4, generator)
    layer = QuantLinear(blocks, None)
    x = torch.randn(5, 96, generator=generator).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, layer(x.float()).bfloat16())


@pytest.mark.parametrize("bits", [4, 8])
def test_our_own_blocks_of_a_float_weight(cpu_kernels, bits):
    """int4: a group's 16 levels span its range; int8: 127 levels of its largest |w|. Each weight is
    off by at most half a level (and float16's rounding of the scale)."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=True)
    layer = QuantLinear.quantize(linear, bits)
    assert layer.bits == bits
    groups = linear.weight.detach().view(64, 4, 32)
    spread = (groups.amax(-1) - groups.amin(-1)) / 15 if bits == 4 else groups.abs().amax(-1) / 127
    error = (layer.dequantized - linear.weight.detach()).view(64, 4, 32).abs().amax(-1)
    assert (error <= spread * 0.51 + 1e-6).all()
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), x @ layer.dequantized.t() + linear.bias, rtol=1e-5, atol=1e-5)


def test_arguments_that_do_not_fit_are_refused_before_the_kernel_runs(cpu_kernels):
    layer = QuantLinear(random_blocks(48, 96, 4, torch.Generator().manual_seed(1)), None)
    op = torch.ops.switchyard_cpu.quant_linear
    x = torch.randn(2, 96)
    for args, message in [
        ((torch.randn(2, 48), layer.qweight, layer.scales, layer.lows, 4, None), "qweight must have shape"),
        ((x.double(), layer.qweight, layer.scales, layer.lows, 4, None), "x must be float32 or bfloat16"),
        ((x, layer.qweight, layer.scales, layer.lows, 8, None), "qweight must be int8"),
        ((x, layer.qweight, layer.scales.float(), layer.lows, 4, None), "of one dtype"),
        ((x, layer.qweight, layer.scales.double(), layer.lows.double(), 4, None), "float16, float32 or int8"),
            ((x, layer.qweight, layer.scales.to(torch.int8), layer.lows.to(torch.int8), 4, None), "int8 scales come with supers"),
            ((x, layer.qweight, layer.scales, layer.lows, 4, None, layer.scales[:, :1].half()), "int8 scales come with supers"),
        ((x, layer.qweight, layer.scales[:1], layer.lows, 4, None), "scales and lows must have shape"),
        ((x, layer.qweight, layer.scales, None, 4, None), "4 and 5 bits need lows"),
        ((x, layer.qweight, layer.scales, layer.lows, 4, torch.zeros(47)), "bias must have shape"),
        ((x, layer.qweight, layer.scales, layer.lows, 3, None), "bits must be 4, 5, 6 or 8"),
        ((torch.randn(2, 95), layer.qweight, layer.scales, layer.lows, 4, None), "16, 32, 64 or 128 times"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            op(*args)
    with pytest.raises(ValueError, match="a multiple of 16"):
        QuantLinear(random_blocks(40, 96, 4, torch.Generator()), None)


# the checkpoints' formats (loader/hf_quant.py): AWQ, GPTQ and compressed-tensors groups of 64 or 128
# inputs, float32 scales and lows, and GPTQ's act-order (the inputs gathered into their groups' order)
@pytest.mark.parametrize(("bits", "group", "low", "act_order"), [(4, 64, True, False), (4, 128, True, False),
                                                                  (4, 128, True, True), (8, 128, True, False),
                                                                  (8, 128, False, False)])
def test_a_checkpoints_groups_and_act_order(variant, bits, group, low, act_order):
    generator = torch.Generator().manual_seed(bits + group)
    n, k = 64, 512
    scale = (torch.rand(n, k // group, generator=generator) * 0.02 + 1e-3).bfloat16().float()
    zero = torch.randint(0, 16 if bits == 4 else 256, (n, k // group), generator=generator).float()
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
        lows = -zero * scale
    else:
        q = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
        lows = (128 - zero) * scale if low else None
    perm = torch.randperm(k, generator=generator) if act_order else None
    blocks = QuantBlocks(q, scale, lows, bits, group, torch.float32, perm)
    layer = QuantLinear(blocks, None)
    assert torch.equal(layer.dequantized, blocks.dequantized)
    x = torch.randn(13, k, generator=generator)
    alone = layer(x[:1])
    for m in (1, 4, 13):
        out = layer(x[:m])
        expected = reference(x[:m], blocks, None)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
        assert torch.equal(out[0], alone[0])
    if act_order:  # input perm[j] is the kernel's column j: the weights are the file's, in the file's order
        dense = blocks.dequantized
        in_kernel_order = torch.addcmul(lows.repeat_interleave(group, 1), q.float(), scale.repeat_interleave(group, 1))
        assert torch.equal(dense[:, perm], in_kernel_order)


# compressed-tensors' FP8 (loader/hf_quant.py): float8 e4m3 codes, a float32 scale per group (a
# channel's repeated); every code but the two NaNs, subnormals and negatives among them
@pytest.mark.parametrize("group", [128, 32])
def test_float8_e4m3_codes_are_torchs_values_times_the_scale(variant, group):
    generator = torch.Generator().manual_seed(group)
    n, k = 48, 512
    codes = torch.randint(0, 256, (n, k), generator=generator, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x01  # NaN in e4m3fn: never a weight
    codes[0, :256] = torch.arange(256, dtype=torch.uint8).masked_fill((torch.arange(256) & 0x7F) == 0x7F, 0)
    q = codes.view(torch.float8_e4m3fn)
    scale = (torch.rand(n, k // group, generator=generator) * 0.02 + 1e-3).bfloat16().float()
    blocks = QuantBlocks(q, scale, None, 8, group, torch.float32)
    layer = QuantLinear(blocks, None)
    assert layer.qweight.dtype == torch.float8_e4m3fn
    weights = q.float() * scale.repeat_interleave(group, 1)  # torch's own e4m3 decoding
    assert torch.equal(layer.dequantized, weights)
    x = torch.randn(13, k, generator=generator)
    unit = torch.zeros(k, k)
    unit[torch.arange(k), torch.arange(k)] = 1.0
    assert torch.equal(layer(unit).t(), weights)  # the kernel decodes each code as torch does, to the bit
    alone = layer(x[:1])
    for m in (1, 4, 13):
        out = layer(x[:m])
        expected = x[:m].double() @ weights.double().t()
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
        assert torch.equal(out[0], alone[0])
