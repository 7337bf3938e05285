"""One sweep point's summary: throughput, and TTFT / TPOT / ITL / E2E at p50, p90, p99 (ms)."""

from __future__ import annotations

import statistics

from bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {f"p{p}": 0.0 for p in PERCENTILES}
    ordered = sorted(values)
    out = {}
    for p in PERCENTILES:
        k = (len(ordered) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        out[f"p{p}"] = 1000 * (ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo))
    return out


def summarize(results: list[RequestResult], wall_s: float, concurrency: int, request_rate: float) -> dict:
    ok = [r for r in results if r.ok]
    num_out = sum(r.num_output_tokens for r in ok)
    point = {
        "concurrency": concurrency, "request_rate": request_rate, "num_requests": len(results),
        "num_failed": len(results) - len(ok), "wall_s": wall_s,
        "output_tok_s": num_out / wall_s if wall_s else 0.0, "req_s": len(ok) / wall_s if wall_s else 0.0,
        "mean_input_tokens": statistics.fmean([r.num_prompt_tokens for r in ok]) if ok else 0.0,
        "mean_output_tokens": statistics.fmean([r.num_output_tokens for r in ok]) if ok else 0.0,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles([r.tpot for r in ok if r.num_output_tokens > 1]),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    engine = [r for r in ok if "engine_ttft" in r.server]
    if engine:  # Switchyard's latency breakdown: what the gateway and the bus add to the engine's TTFT
        point["engine_ttft_ms"] = percentiles([r.server["engine_ttft"] for r in engine])
        point["gateway_bus_ms"] = percentiles([r.ttft - r.server["engine_ttft"] for r in engine])
        # ...split into its legs: API arrival to the scheduler's receipt; first token sampled to
        # first delta handed to the client by the API; the HTTP legs, i.e. client TTFT minus the
        # API's first byte: the request's way in (client start to arrival at the API, one clock)
        # and the first delta's way out, with the client's parsing
        legs = [r for r in engine if "first_byte" in r.server]
        point["to_engine_ms"] = percentiles([r.server["received"] for r in legs])
        point["to_api_ms"] = percentiles([r.server["first_byte"] - r.server["first_token"] for r in legs])
        point["http_ms"] = percentiles([r.ttft - r.server["first_byte"] for r in legs])
        way_in = [(r, r.server["arrived_at"] - r.started_at) for r in legs if "arrived_at" in r.server]
        if way_in:
            point["http_in_ms"] = percentiles([t for _, t in way_in])
            point["http_out_ms"] = percentiles([r.ttft - r.server["first_byte"] - t for r, t in way_in])
            # the way in, split where the client wrote the request's headers: the client's own time
            # (its event loop, connecting, writing) and the rest (the kernel, the gateway's accept and parse)
            sent = [r for r, _ in way_in if r.sent_at]
            if sent:
                point["client_send_ms"] = percentiles([r.sent_at - r.started_at for r in sent])
                point["to_gateway_ms"] = percentiles([r.server["arrived_at"] - r.sent_at for r in sent])
    return point
