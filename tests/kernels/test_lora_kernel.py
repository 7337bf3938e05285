"""The CUDA backend's grouped LoRA GEMM (Triton BGMV) against the torch backend's grouped op: a mixed
batch of decode rows and prefill runs on several slots and the base, widths off the tile grid; on
the CPU under TRITON_INTERPRET=1 in float32 and float16, and on a GPU, where there is one, in
bfloat16 too."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.cuda.kernels.lora import lora_add
from services.worker.backends.torch_cpu.lora import lora_add as torch_lora_add
from services.worker.lora.layers import LoraRows
from tests.kernels.test_kernels import DEVICE, DTYPES, TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("fan_in", "out", "width"), [(128, 96, 48), (72, 200, 16)])
def test_bgmv_matches_the_torch_grouped_lora(dtype, fan_in, out, width):
    gen = torch.Generator().manual_seed(0)
    num_slots = 3
    slots_per_row, tokens_per_row = [0, -1, 2, 0, 1, -1, 2], [1, 1, 1, 9, 5, 3, 1]  # decode rows, then prefills
    rows = LoraRows.of(slots_per_row, tokens_per_row, torch.device(DEVICE))
    num_tokens = sum(tokens_per_row)
    x = torch.randn(num_tokens, fan_in, generator=gen).to(dtype=dtype, device=DEVICE)
    y = torch.randn(num_tokens, out, generator=gen).to(dtype=dtype, device=DEVICE)
    a = (torch.randn(num_slots, width, fan_in, generator=gen) / fan_in**0.5).to(dtype=dtype, device=DEVICE)
    b = (torch.randn(num_slots, out, width, generator=gen) / width**0.5).to(dtype=dtype, device=DEVICE)
    expected = torch_lora_add(x.float().cpu(), y.float().cpu().clone(), a.float().cpu(), b.float().cpu(),
                              LoraRows.of(slots_per_row, tokens_per_row, torch.device("cpu")))
    ours = lora_add(x, y.clone(), a, b, rows)
    torch.testing.assert_close(ours.float().cpu(), expected, **TOLERANCE[dtype])
    base_rows = rows.token_slots.cpu() < 0
    assert torch.equal(ours.cpu()[base_rows], y.cpu()[base_rows])  # the base model's rows are untouched
