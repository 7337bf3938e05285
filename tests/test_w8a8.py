"""`--quantization w8a8`: fbgemm's int8 GEMM computes exactly the scheme w8a8.py describes (int8
weights per channel, int8 activations per token), a row's result does not depend on its batch, and
no int16 pair saturates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.worker.backends.torch_cpu import w8a8
from services.worker.backends.torch_cpu.w8a8 import ROW_SCALE, ROW_ZERO_POINT, WEIGHT_LEVELS, W8A8Linear

pytestmark = pytest.mark.skipif(not w8a8.available(), reason="fbgemm is not in this torch build")


def _reference(q: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The scheme in plain float64: each row on its own uint8 grid, times the int8 weights."""
    rows = x.double()
    row_max = rows.abs().amax(-1, keepdim=True)
    levels = torch.clamp(torch.round(rows / row_max / ROW_SCALE) + ROW_ZERO_POINT, 0, 255)
    return ((levels - ROW_ZERO_POINT) * ROW_SCALE * row_max) @ q.dequantized.double().t()


def test_w8a8_linear_computes_the_per_token_scheme():
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True)
    q = W8A8Linear(linear)
    weight_step = linear.weight.abs().amax(1, keepdim=True) / WEIGHT_LEVELS
    assert ((q.dequantized - linear.weight).abs() <= weight_step / 2 + 1e-6).all()  # rounding only
    x = torch.randn(7, 96) * torch.logspace(-2, 2, 7)[:, None]  # rows of very different sizes
    out = q(x)
    expected = _reference(q, x) + linear.bias.double()
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    # and it is still the Linear, up to the int8 error of activations and weights
    torch.testing.assert_close(out, linear(x), atol=0.05 * linear(x).abs().max().item(), rtol=0)


def test_a_rows_result_does_not_depend_on_its_batch():
    torch.manual_seed(1)
    q = W8A8Linear(nn.Linear(64, 32, bias=False))
    row = torch.randn(1, 64)
    alone = q(row)
    others = torch.randn(9, 64) * 1000  # a per-tensor scale would flatten `row` to a few levels
    batched = q(torch.cat([others[:4], row, others[4:]]))[4:5]
    assert torch.equal(alone, batched)


def test_no_int16_pair_saturates():
    # every weight at its channel's max and every activation at the row's max: each pair of
    # u8 x s8 products is 255 * 63 * 2, the largest the scheme makes; with 8-bit weights it would
    # pass 2^15 and vpmaddubsw would clamp it
    linear = nn.Linear(128, 8, bias=False)
    with torch.no_grad():
        linear.weight.fill_(0.5)
        linear.weight[1::2] = -0.5
    q = W8A8Linear(linear)
    x = torch.ones(3, 128)
    torch.testing.assert_close(q(x), linear(x), atol=1e-4, rtol=1e-4)


def test_bfloat16_rows_come_back_bfloat16_and_3d_inputs_keep_their_shape():
    torch.manual_seed(2)
    linear = nn.Linear(32, 16, bias=False)
    q = W8A8Linear(linear.to(torch.bfloat16))
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    out = q(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 16)
    torch.testing.assert_close(out.float(), q(x.float().reshape(6, 32)).reshape(2, 3, 16), atol=0.05, rtol=0.02)


def test_two_linears_of_one_shape_in_one_compiled_graph_each_use_their_own_weight():
    # the compiled decode layers share one graph between runs of layers (compiled.py): the packed
    # weight must come in as a graph input (the handle), never be baked in as a constant
    torch.manual_seed(3)
    first, second = W8A8Linear(nn.Linear(32, 16, bias=False)), W8A8Linear(nn.Linear(32, 16, bias=False))
    compiled = torch.compile(lambda layer, x: layer(x) * 2, dynamic=True,
                             options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    x = torch.randn(3, 32)
    for layer in (first, second, first):
        torch.testing.assert_close(compiled(layer, x), layer(x) * 2, atol=1e-5, rtol=1e-5)


def test_the_packed_weights_count_toward_the_models_memory():
    from services.worker.backends.spec import weight_bytes

    model = nn.Sequential(W8A8Linear(nn.Linear(64, 32, bias=True)))
    assert weight_bytes(model) >= 64 * 32 + 32 * 4  # int8 weights held by fbgemm, float32 bias
