"""`python -m bench.kv_tier`: multi-turn chat whose KV is several times the pool, with the host KV
tier (--kv-offloading-size) and without it (every evicted history recomputed), and with a tier too
small for it and a disk behind it (--kv-offloading-disk-size).

    python -m bench.kv_tier [--conversations 16 --turns 4 --history 768 --pool-blocks 240]
    python -m bench.kv_tier --disk-gib 1 --disk-tier-gib 0.1 --disk-dir /var/tmp

A stack of `make run`'s services (one worker, its defaults) serves conversations one request at a
time, round robin, so each conversation's history is evicted from the pool by the others' before
its next turn. A turn sends the whole history (token ids) and appends the answer's ids and the next
user message's; TTFT is the client's, from the first streamed chunk. Reported: TTFT p50 / p90 of
the first turns (cold either way) and of the later ones, and the tier's hits from /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import time

import aiohttp
import httpx

from bench.cpu_flags import cpu_name
from switchyard.launcher import Stack
from switchyard.nats_server import NatsServer, free_port

BLOCK_SIZE = 16


async def turn(session: aiohttp.ClientSession, base_url: str, model: str, prompt: list[int],
               max_tokens: int) -> tuple[float, list[int]]:
    """One streamed greedy completion of token ids: (TTFT, the answer's token ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    started, ttft, answer = time.perf_counter(), None, []
    async with session.post(f"{base_url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            answer += chunk["choices"][0].get("token_ids") or []
    return ttft, answer


async def conversations(base_url: str, model: str, args: argparse.Namespace) -> dict[int, list[float]]:
    """TTFTs by turn number, every conversation's turns in round-robin order."""
    rng = random.Random(0)
    histories = [[rng.randrange(100, 40000) for _ in range(args.history)] for _ in range(args.conversations)]
    ttfts: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for t in range(args.turns):
            for history in histories:
                ttft, answer = await turn(session, base_url, model, history, args.answer)
                ttfts[t].append(ttft)
                history += answer + [rng.randrange(100, 40000) for _ in range(args.user)]
    return ttfts


def run(args: argparse.Namespace, tier_gib: float, disk_gib: float = 0.0) -> tuple[dict[int, list[float]], float]:
    bus = NatsServer(auth=True).start()
    max_len = args.history + args.turns * (args.answer + args.user) + 64
    flags = ["--num-kv-blocks", str(args.pool_blocks), "--max-model-len", str(max_len),
             "--kv-offloading-size", str(tier_gib), *shlex.split(args.service_args)]
    if disk_gib:
        flags += ["--kv-offloading-disk-size", str(disk_gib), "--kv-offloading-disk-dir", args.disk_dir]
    stack = Stack(nats_url=bus.url, auth_dir=bus.auth_dir, api_port=free_port(), num_workers=1, service_args=flags)
    stack.nats = bus
    stack.start()
    try:
        stack.wait_ready()
        model = httpx.get(f"{stack.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        ttfts = asyncio.run(conversations(stack.base_url, model, args))
        metrics = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
        hits = sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("vllm:external_prefix_cache_hits_total"))
        return ttfts, hits
    finally:
        stack.stop()


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--history", type=int, default=768, help="first turn's prompt, in tokens")
    parser.add_argument("--answer", type=int, default=16, help="tokens each answer has")
    parser.add_argument("--user", type=int, default=48, help="tokens each later user message adds")
    parser.add_argument("--pool-blocks", type=int, default=240, help="the worker's KV pool (--num-kv-blocks)")
    parser.add_argument("--tier-gib", type=float, default=1.0, help="--kv-offloading-size of the tier run")
    parser.add_argument("--service-args", default="", help="more flags for every service")
    parser.add_argument("--disk-gib", type=float, default=0.0, help="a third run: a disk spill of this size...")
    parser.add_argument("--disk-tier-gib", type=float, default=0.1, help="... behind a tier of this size")
    parser.add_argument("--disk-dir", default="/var/tmp", help="... in this folder")
    args = parser.parse_args()
    final = args.history + (args.turns - 1) * (args.answer + args.user)
    kv_blocks = args.conversations * final // BLOCK_SIZE
    print(f"{cpu_name()}; {args.conversations} conversations x {args.turns} turns, histories {args.history} -> "
          f"{final} tokens: their KV {kv_blocks} blocks, {kv_blocks / args.pool_blocks:.1f}x the pool's "
          f"{args.pool_blocks}")
    results = {}
    for label, gib in (("recompute (no tier)", 0.0), (f"host tier ({args.tier_gib} GiB)", args.tier_gib)):
        results[label] = run(args, gib)
    if args.disk_gib:
        label = f"tier ({args.disk_tier_gib} GiB) + disk ({args.disk_gib} GiB, {args.disk_dir})"
        results[label] = run(args, args.disk_tier_gib, args.disk_gib)
    print("| KV of an evicted history | first turns TTFT p50 / p90 (s) | later turns TTFT p50 / p90 (s) "
          "| tokens loaded from the tier |")
    print("|---|---|---|---|")
    for label, (ttfts, hits) in results.items():
        later = [x for t in range(1, args.turns) for x in ttfts[t]]
        print(f"| {label} | {_p(ttfts[0], 50):.3f} / {_p(ttfts[0], 90):.3f} | {_p(later, 50):.3f} / "
              f"{_p(later, 90):.3f} | {hits:.0f} |")
    base = next(iter(results.values()))[0]
    for label, (ttfts, _) in list(results.items())[1:]:
        ratio = statistics.median([x for t in range(1, args.turns) for x in base[t]]) / \
            statistics.median([x for t in range(1, args.turns) for x in ttfts[t]])
        print(f"later turns' TTFT p50: {ratio:.1f}x lower with the {label}")


if __name__ == "__main__":
    main()
