"""Benchmark results as JSON and a markdown table; `compare` prints B's ratios to A."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [("c", lambda p: p["concurrency"]), ("rate", lambda p: p["request_rate"]),
           ("req", lambda p: p["num_requests"]), ("fail", lambda p: p["num_failed"]),
           ("out tok/s", lambda p: f"{p['output_tok_s']:.1f}"), ("req/s", lambda p: f"{p['req_s']:.2f}")]
for _metric in ("ttft", "tpot", "itl", "e2e"):
    for _p in ("p50", "p90", "p99"):
        COLUMNS.append((f"{_metric.upper()} {_p}", lambda p, m=_metric, q=_p: f"{p[m + '_ms'][q]:.1f}"))
for _name, _key in (("gw+bus", "gateway_bus_ms"), ("to engine", "to_engine_ms"), ("to api", "to_api_ms"),
                   ("http in", "http_in_ms"), ("client send", "client_send_ms"), ("to gateway", "to_gateway_ms"),
                   ("http out", "http_out_ms")):
    COLUMNS.append((f"{_name} p50", lambda p, k=_key: f"{p[k]['p50']:.2f}" if k in p else "-"))


def markdown(run: dict) -> str:
    lines = [f"**{run['label']}** ({run['dataset']}, input {run['input_len']}, output {run['output_len']}, "
             f"ignore_eos {run['ignore_eos']}); times in ms", "",
             "| " + " | ".join(name for name, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for point in run["points"]:
        lines.append("| " + " | ".join(str(get(point)) for _, get in COLUMNS) + " |")
    return "\n".join(lines)


def save(run: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(run, indent=2))
    Path(path).with_suffix(".md").write_text(markdown(run) + "\n")


def compare(path_a: str, path_b: str) -> str:
    """Per concurrency point: B / A for throughput, A / B for latencies (above 1 = B better)."""
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    by_c = {p["concurrency"]: p for p in a["points"]}
    lines = [f"{b['label']} vs {a['label']} (> 1: {b['label']} better)", "",
             "| c | out tok/s | TTFT p50 | TPOT p50 | E2E p50 |", "|---|---|---|---|---|"]
    for pb in b["points"]:
        pa = by_c.get(pb["concurrency"])
        if pa is None:
            continue

        throughput = pb["output_tok_s"] / pa["output_tok_s"] if pa["output_tok_s"] else 0.0
        ratios = " | ".join(_latency_ratio(pa, pb, m) for m in ("ttft_ms", "tpot_ms", "e2e_ms"))
        lines.append(f"| {pb['concurrency']} | {throughput:.2f} | {ratios} |")
    return "\n".join(lines)


def _latency_ratio(a: dict, b: dict, metric: str) -> str:
    ours = b[metric]["p50"]
    return f"{a[metric]['p50'] / ours:.2f}" if ours else "-"
