"""`python -m bench.cold_start`: a stack's first minutes, from a cold start (a fresh Inductor cache).

    python -m bench.cold_start [--switchyard-args "--compile"] [--seconds 90]

Starts `make run`'s stack (the launcher, its defaults, plus `--switchyard-args`), then: the seconds
until /health is ready, the TTFT of the first request (the 37-token chat prompt "What is the
capital of France?", streamed, greedy, no prefix-cache hit) and, for `--seconds`, one such request
after another, each tagged with the worker's device line at its start (`compiling decode steps`
while a --compile compiles): TTFT and TPOT medians for each phase, and whether every answer was the
first one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from bench.cpu_flags import cpu_name
from switchyard.launcher import Stack
from switchyard.nats_server import free_port

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


def ask(client: httpx.Client) -> tuple[float, float, str]:
    """(TTFT, TPOT, text) of one streamed greedy chat answer of up to 32 tokens; a cache salt of its own,
    so the whole prompt is computed each time (no prefix-cache hit)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32, "temperature": 0,
            "stream": True, "cache_salt": uuid.uuid4().hex}
    started, stamps, text = time.perf_counter(), [], []
    with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if piece := choices[0].get("delta", {}).get("content"):
                stamps.append(time.perf_counter())
                text.append(piece)
    ttft = stamps[0] - started
    return ttft, (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1), "".join(text)


def device(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["devices"][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switchyard-args", default="", help="more flags for the stack, e.g. '--compile'")
    p.add_argument("--seconds", type=float, default=90, help="how long to keep asking after the first request")
    p.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = p.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cold-inductor-")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-cold-"))
    started = time.monotonic()
    stack = Stack(api_port=free_port(), log_dir=log_dir, service_args=args.switchyard_args.split()).start()
    try:
        stack.wait_ready()
        ready_s = time.monotonic() - started
        with httpx.Client(base_url=stack.base_url, timeout=300) as client:
            first_device = device(client)
            first = ask(client)
            phases: dict[str, list[tuple[float, float, str]]] = {}
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                phase = device(client)
                phases.setdefault(phase, []).append(ask(client))
    finally:
        stack.stop()
    result = {"cpu": cpu_name(), "args": args.switchyard_args, "ready_s": round(ready_s, 1),
              "first": {"device": first_device, "ttft_ms": round(first[0] * 1e3, 1), "tpot_ms": round(first[1] * 1e3, 2),
                        "text": first[2]},
              "phases": {phase: {"requests": len(runs),
                                 "ttft_ms_p50": round(statistics.median(r[0] for r in runs) * 1e3, 1),
                                 "tpot_ms_p50": round(statistics.median(r[1] for r in runs) * 1e3, 2),
                                 "same_answer": sum(r[2] == first[2] for r in runs)}
                         for phase, runs in phases.items()}}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
