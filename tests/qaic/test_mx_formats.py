"""MXFP6 (E2M3) and MXINT8 against the OCP MX v1.0 spec's values and blocks computed by hand."""

import pytest
import torch

from services.worker.backends.qaic.mx import (
    FP6_VALUES,
    MXFP6Tensor,
    fp6_encode,
    int8_decode,
    int8_encode,
    pack6,
    unpack6,
)


def block(*head: float, fill: float = 0.0) -> torch.Tensor:
    return torch.tensor([*head] + [fill] * (32 - len(head)), dtype=torch.float32).view(1, 32)


def test_e2m3_element_values_are_the_specs():
    # the spec's E2M3 table: max normal 7.5, min normal 1.0, max subnormal 0.875, min subnormal 0.125
    assert FP6_VALUES[0b011111] == 7.5
    assert FP6_VALUES[0b001000] == 1.0
    assert FP6_VALUES[0b000111] == 0.875
    assert FP6_VALUES[0b000001] == 0.125
    assert FP6_VALUES[0b111111] == -7.5
    assert FP6_VALUES[0b010100] == 3.0  # exponent field 2 (2^1), mantissa 4 (1.5)
    assert sorted(set(FP6_VALUES.abs().tolist())) == [i / 8 for i in range(16)] + \
        [2 + i / 4 for i in range(8)] + [4 + i / 2 for i in range(8)]


def test_every_code_decodes_and_encodes_back_to_itself():
    codes = torch.arange(64, dtype=torch.uint8)
    again = fp6_encode(FP6_VALUES[codes.long()])
    assert again[codes != 32].tolist() == codes[codes != 32].tolist()
    assert again[32] == 0  # -0 is stored as +0


def test_rounding_is_half_to_even_and_saturates():
    values = torch.tensor([0.0625, 0.1875, 2.125, 2.375, 5.25, 7.9, 100.0, -0.0625, -2.375])
    assert FP6_VALUES[fp6_encode(values).long()].tolist() == [0.0, 0.25, 2.0, 2.5, 5.0, 7.5, 7.5, 0.0, -2.5]


def test_mxfp6_block_whose_max_is_a_power_of_two():
    t = MXFP6Tensor.encode(block(4.0, 1.0, -1.5, 0.375))
    assert t.scales.tolist() == [[127]]  # floor(log2 4) - emax 2 = 0 -> 2^0
    codes = unpack6(t.packed)
    assert codes[0, :4].tolist() == [0b011000, 0b001000, 0b101100, 0b000011]
    assert t.decode()[0, :4].tolist() == [4.0, 1.0, -1.5, 0.375]


def test_mxfp6_scale_and_saturation():
    t = MXFP6Tensor.encode(block(8.0, 3.0, 15.9))  # max 15.9: floor(log2) 3 -> scale 2^1
    assert t.scales.tolist() == [[128]]
    assert t.decode()[0, :3].tolist() == [8.0, 3.0, 15.0]  # 15.9 / 2 = 7.95 saturates to 7.5


def test_mxfp6_zero_block_and_extremes():
    zero = MXFP6Tensor.encode(block())
    assert zero.scales.tolist() == [[0]] and zero.decode().abs().sum() == 0
    tiny = MXFP6Tensor.encode(block(2.0**-130))  # float32 subnormal: the scale clamps at 2^-127
    assert tiny.scales.tolist() == [[0]]
    assert tiny.decode()[0, 0] == 2.0**-130  # 2^-3 * 2^-127: the smallest subnormal element
    huge = MXFP6Tensor.encode(block(2.0**127))
    assert huge.scales.tolist() == [[252]] and huge.decode()[0, 0] == 2.0**127


def test_pack6_bit_layout_and_size():
    assert pack6(torch.tensor([1, 2, 3, 4], dtype=torch.uint8)).tolist() == [0x81, 0x30, 0x10]
    codes = torch.randint(0, 64, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack6(pack6(codes)), codes)
    t = MXFP6Tensor.encode(torch.randn(64, 128))
    assert t.nbytes * 8 / (64 * 128) == 6.25


def test_mxfp6_error_is_bounded_by_the_grid():
    x = torch.randn(128, 256)
    err = (MXFP6Tensor.encode(x).decode() - x).abs()
    amax = x.view(128, 8, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(128, 256)
    assert (err <= amax / 16 + 1e-7).all()  # half of the coarsest step (2^(e-3) at scale 2^(e-2))


def test_mxint8_hand_computed_blocks():
    q, s = int8_encode(block(1.0, 0.5, -1.0, 1 / 128, 3 / 128, 127 / 64))
    assert s.tolist() == [[127]] and q[0, :6].tolist() == [64, 32, -64, 0, 2, 127]
    q, s = int8_encode(block(3.0, -1.999))  # scale 2^1: 3 -> 96; -1.999 / 2 * 64 = -63.97 -> -64
    assert s.tolist() == [[128]] and q[0, :2].tolist() == [96, -64]
    q, s = int8_encode(block(-1.999, 1.0))  # scale 2^0: -127.94 saturates to -127, never -128
    assert q[0, :2].tolist() == [-127, 64]
    q, s = int8_encode(block())
    assert s.tolist() == [[0]] and q.abs().sum() == 0
    assert int8_decode(torch.tensor([[-128] + [0] * 31], dtype=torch.int8), torch.tensor([[127]],
                       dtype=torch.uint8))[0, 0] == -2.0


def test_mxint8_round_trip_error():
    x = torch.randn(4, 3, 64)
    q, s = int8_encode(x)
    assert q.dtype == torch.int8 and s.shape == (4, 3, 2)
    err = (int8_decode(q, s) - x).abs()
    amax = x.view(4, 3, 2, 32).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 32).reshape(4, 3, 64)
    assert (err <= amax / 128 + 1e-7).all()  # half a step of 2^(e-6) at amax >= 2^e


def test_blocks_must_be_whole():
    with pytest.raises(ValueError, match="32 elements"):
        MXFP6Tensor.encode(torch.ones(2, 48))
