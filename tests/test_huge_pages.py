"""The CPU worker's weights in huge pages: the same values, ties kept, resident in their bytes, handed back with them."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from bench.memory import mapping_kib
from services.worker.backends.torch_cpu.huge_pages import HUGE_PAGE, move_to_huge_pages


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.read_text().split("[")[1].split("]")[0] if path.exists() else "never"


def test_big_weights_move_small_ones_and_views_stay_and_ties_hold():
    big = nn.Linear(1024, 1536, bias=False)  # 6 MiB of float32: three huge pages
    head = nn.Linear(1024, 1536, bias=False)
    head.weight = big.weight  # tied, as an output head to its embedding
    small = nn.Linear(64, 64)
    model = nn.ModuleList([big, head, small])
    base = torch.arange(2 * HUGE_PAGE, dtype=torch.uint8)
    model.register_buffer("view", base[: HUGE_PAGE + 8])  # not its storage's whole: left where it is
    want, small_at, view_at = big.weight.detach().clone(), small.weight.data_ptr(), model.view.data_ptr()

    calls = []
    assert move_to_huge_pages(model, then=lambda: calls.append(1)) == want.nbytes
    assert len(calls) == 3  # before the first copy, and after each of the tie's two modules
    assert big.weight is head.weight and isinstance(big.weight, nn.Parameter) and not big.weight.requires_grad
    assert torch.equal(big.weight, want) and big.weight.data_ptr() % HUGE_PAGE == 0
    assert small.weight.data_ptr() == small_at and model.view.data_ptr() == view_at
    x = torch.randn(3, 1024)
    torch.testing.assert_close(head(x), x @ want.T, rtol=0, atol=0)

    mapping = mapping_kib(big.weight.data_ptr())
    assert mapping["Rss"] * 1024 <= want.nbytes  # resident in its bytes, no huge page past them
    if _thp_mode() != "never":
        assert mapping["AnonHugePages"] > 0
    address = big.weight.data_ptr()
    del big, head, model
    gc.collect()
    assert mapping_kib(address) is None  # unmapped with the tensor's storage


def test_a_quantized_linear_computes_the_same_from_its_moved_blocks(cpu_kernels):
    from services.worker.backends.torch_cpu.quantization import QuantLinear
    from services.worker.loader.gguf_blocks import decode
    from tests.test_gguf_kquants import random_raw

    layer = QuantLinear(decode("Q4_K", random_raw("Q4_K", 4096, 2048, np.random.default_rng(3))), None)
    layer.use_int8_rows()
    x = torch.randn(2, 2048)
    want = layer(x)
    assert move_to_huge_pages(layer) == layer.qweight.nbytes  # the 4 MiB of values; scales stay
    assert layer.qweight.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(layer(x), want)


@pytest.mark.skipif(_thp_mode() == "always", reason="every anonymous mapping is in huge pages already")
def test_a_mapping_without_the_advice_has_none():
    """The control for the tests above: the same bytes in a mapping of their own without the advice are
    in small pages. (Not a torch allocation: the heap may reuse memory numpy advised for its arrays.)"""
    plain = torch.frombuffer(mmap.mmap(-1, 3 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                             dtype=torch.uint8)
    plain.fill_(1)
    assert mapping_kib(plain.data_ptr())["AnonHugePages"] == 0
