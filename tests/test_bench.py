"""The serving benchmark runs end to end on a tiny sweep and produces every metric."""

from __future__ import annotations

import json

import pytest

from bench import serve

pytestmark = pytest.mark.stack


def test_tiny_sweep_reports_every_metric_and_compares(stack, model_name, tmp_path, capsys):
    common = ["--base-url", stack.base_url, "--model", model_name, "--input-len", "24", "--output-len", "4-6",
              "--num-prompts", "4", "--warmup", "1", "--no-progress"]
    serve.main([*common, "--concurrency", "1,2", "--out", str(tmp_path / "a.json"), "--label", "a"])
    serve.main([*common, "--concurrency", "2", "--dataset", "random", "--endpoint", "chat",
                "--request-rate", "50", "--out", str(tmp_path / "b.json"), "--label", "b"])
    run = json.loads((tmp_path / "a.json").read_text())
    assert [p["concurrency"] for p in run["points"]] == [1, 2]
    for point in run["points"]:
        assert point["num_failed"] == 0 and point["num_requests"] == 4
        assert point["output_tok_s"] > 0 and point["req_s"] > 0
        assert 4 <= point["mean_output_tokens"] <= 6 and 20 <= point["mean_input_tokens"] <= 28
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "engine_ttft_ms", "gateway_bus_ms", "to_engine_ms",
                       "to_api_ms", "http_ms", "http_in_ms", "http_out_ms", "client_send_ms", "to_gateway_ms"):
            assert set(point[metric]) == {"p50", "p90", "p99"}, metric
        assert 0 < point["ttft_ms"]["p50"] <= point["e2e_ms"]["p50"]
        assert 0 < point["engine_ttft_ms"]["p50"] < point["ttft_ms"]["p50"]  # the engine's share of TTFT
        assert all(point[leg]["p50"] > 0 for leg in ("to_engine_ms", "to_api_ms", "http_ms", "http_in_ms", "http_out_ms",
                                                      "client_send_ms", "to_gateway_ms"))
        assert point["client_send_ms"]["p50"] < point["http_in_ms"]["p90"]  # a part of the way in
    assert "| c | rate |" in (tmp_path / "a.md").read_text()
    capsys.readouterr()
    serve.main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert "b vs a" in capsys.readouterr().out


def test_transformers_peer_times_static_batches(hf_model, hf_tokenizer):
    """The static-batching peer: every request of a batch waits for the batch; its own tokens count."""
    import time

    from bench.dataset import Prompt
    from bench.hf_static import run_batch

    prompts = [Prompt(hf_tokenizer.encode("The capital of France is"), 5, 3),
               Prompt(hf_tokenizer.encode("Once upon a time, in a land far away"), 10, 6)]
    t0 = time.perf_counter()
    short, long = run_batch(hf_model, prompts, t0)
    assert (short.num_output_tokens, long.num_output_tokens) == (3, 6)
    assert short.ttft == long.ttft  # one prefill for the batch
    assert len(short.itl) == 2 and len(long.itl) == 5 and short.e2e < long.e2e


def test_the_embeddings_bench_measures_each_way(stack, model_name):
    import asyncio

    from bench.embeddings import measure

    texts = [f"The number {i} is written in words." for i in range(6)]
    rates = asyncio.run(measure(stack.base_url, model_name, texts, concurrency=2))
    assert list(rates) == ["one request, every input", "one input a request, one at a time",
                           "one input a request, 2 at a time"]
    assert all(rate > 0 for rate in rates.values())
