"""The host KV tier's pinned, asynchronous copies on a real GPU: bench/tier_copies.py at a CI size
(its round trip checked bit for bit), and the gpu_decode benchmark's 4-bit weights. (Copies of
every dtype: tests/test_host_tier.py; the tier under a model: tests/kernels/test_cuda_backend.py.)"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_tier_copies_benchmark_pins_the_tier_and_reports_both_ways():
    from bench import tier_copies

    report = tier_copies.main(["--blocks", "8", "--layers", "2", "--gemm", "512", "--gemms", "2", "--repeat", "2"])
    for mode in ("pinned", "pageable"):
        figures = report["modes"][mode]
        assert figures["save_gb_s"] > 0 and figures["load_gb_s"] > 0, figures


def test_the_gpu_benchmark_runs_4_bit_weights_on_the_quantized_gemm(tmp_path):
    from bench import gpu_decode

    config = json.loads(open("bench/configs/llama-3.1-8b.json").read())
    config.update(num_hidden_layers=2, hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                  num_key_value_heads=1, vocab_size=1000)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    report = gpu_decode.main(["--config", str(path), "--context", "64", "--big-batch", "8", "--prefill-len", "256",
                              "--repeat", "3", "--weights", "int4"])
    assert report["weights"] == "int4" and report["decode_b1"]["tok_s"] > 0 and report["prefill"]["tflop_s"] > 0
