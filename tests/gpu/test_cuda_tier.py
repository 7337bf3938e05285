"""The host KV tier's pinned, asynchronous copies on a real GPU: bench/tier_copies.py at a CI size
(its round trip checked bit for bit). (Copies of every dtype: tests/test_host_tier.py; the tier
under a model: tests/kernels/test_cuda_backend.py.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_tier_copies_benchmark_pins_the_tier_and_reports_both_ways():
    from bench import tier_copies

    report = tier_copies.main(["--blocks", "8", "--layers", "2", "--gemm", "512", "--gemms", "2", "--repeat", "2"])
    for mode in ("pinned", "pageable"):
        figures = report["modes"][mode]
        assert figures["save_gb_s"] > 0 and figures["load_gb_s"] > 0, figures
