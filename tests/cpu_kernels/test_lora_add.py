"""lora.c (the grouped LoRA GEMM) against the torch reference's grouped op, in every variant this
CPU runs: decode rows and prefill runs on several slots and the base, widths off the vector grid."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.ops import NATIVE_OPS, TORCH_OPS
from services.worker.lora.layers import LoraRows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fan_in", "out_sizes", "width", "tokens_per_row"),
                         [(576, [576, 192, 192], 24, [1, 1, 1, 1, 1, 1, 1]), (72, [200], 13, [1, 1, 1, 9, 5, 3, 1]),
                          (1536, [576], 8, [40, 1, 90]), (96, [40, 40], 10, [17, 33, 1])])
def test_lora_add_matches_torch(variant, dtype, fan_in, out_sizes, width, tokens_per_row):
    """Decode rows, prefill runs past the kernel's 16-token chunks, and B block-diagonal over q|k|v or
    gate|up slices (the kernel reads only the blocks)."""
    gen = torch.Generator().manual_seed(0)
    slots_per_row = [0, -1, 2, 0, 1, -1, 2][: len(tokens_per_row)]
    rows = LoraRows.of(slots_per_row, tokens_per_row, torch.device("cpu"))
    num_tokens = sum(tokens_per_row)
    x = torch.randn(num_tokens, fan_in, generator=gen).to(dtype)
    a = (torch.randn(3, width, fan_in, generator=gen) / fan_in**0.5).to(dtype)
    out, rank = sum(out_sizes), width // len(out_sizes)
    b = (torch.randn(3, out, width, generator=gen) / rank**0.5)
    for i in range(len(out_sizes)):  # zero outside slice i's block, as LoraLinear stores it
        rows_i = slice(sum(out_sizes[:i]), sum(out_sizes[: i + 1]))
        b[:, rows_i, : i * rank] = 0
        b[:, rows_i, (i + 1) * rank :] = 0
    b = b.to(dtype)
    y = torch.randn(num_tokens, out, generator=gen).to(dtype)
    expected = TORCH_OPS.lora_add(x.float(), y.float().clone(), a.float(), b.float(), rows, out_sizes)
    ours = NATIVE_OPS.lora_add(x, y.clone(), a, b, rows, out_sizes)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(ours.float(), expected, **tolerance)
    base = rows.token_slots < 0
    assert torch.equal(ours[base], y[base])  # the base model's rows are untouched


def test_lora_add_refuses_a_slot_out_of_range(variant):
    x, y = torch.randn(2, 64), torch.randn(2, 32)
    a, b = torch.randn(2, 8, 64), torch.randn(2, 32, 8)
    with pytest.raises(RuntimeError, match=r"slots\[1\] = 2 is not -1 or one of the 2 slots"):
        torch.ops.switchyard_cpu.lora_add_(y, x, a, b, torch.tensor([0, 2]), [32])
