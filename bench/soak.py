"""`python -m bench.soak`: a long run at fixed concurrency; every service's memory, sampled as it goes.

    python -m bench.soak [--minutes 60 --concurrency 32 --sample-s 60]

Starts its own stack (one worker, a locked bus), keeps `--concurrency` streamed completions in
flight (English prompts of 16-256 tokens, 16-128 output tokens each) and prints, every
`--sample-s`, each service's resident memory (VmRSS less the KV pool's shared memory, which becomes
resident as its blocks are first used: bench/memory.py; MiB) with the requests done and failed so
far. docs/benchmarks.md has the curve; flat after warm-up is the bar.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import openai

from bench.faults import MODEL
from bench.memory import private_rss_bytes
from switchyard.launcher import Stack
from switchyard.nats_server import NatsServer, free_port

WORDS = "the of and to in is was for on that with as by at from it his an were are which".split()


def rss_mib(pid: int) -> float:
    return private_rss_bytes(pid) / 2**20


async def load(client: openai.AsyncOpenAI, stop_at: float, counts: dict[str, int], seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 256)))
        try:
            chunks = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=rng.randint(16, 128),
                                                     stream=True, temperature=0.7)
            async for _ in chunks:
                pass
            counts["done"] += 1
        except openai.APIError as exc:
            counts["failed"] += 1
            counts.setdefault(type(exc).__name__, 0)
            counts[type(exc).__name__] += 1


async def soak(stack: Stack, minutes: float, concurrency: int, sample_s: float) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    counts = {"done": 0, "failed": 0}
    started = time.monotonic()
    stop_at = started + minutes * 60
    names = [s.name for s in stack.services] + ["nats"]
    pids = {s.name: s.proc.pid for s in stack.services} | {"nats": stack.nats.proc.pid}
    print("| minute | " + " | ".join(f"{n} RSS (MiB)" for n in names) + " | requests done | failed |")
    print("|---" * (len(names) + 3) + "|", flush=True)
    workers = [asyncio.create_task(load(client, stop_at, counts, i)) for i in range(concurrency)]
    while time.monotonic() < stop_at:
        row = " | ".join(f"{rss_mib(pids[n]):.0f}" for n in names)
        print(f"| {(time.monotonic() - started) / 60:.0f} | {row} | {counts['done']} | {counts['failed']} |", flush=True)
        await asyncio.sleep(min(sample_s, max(stop_at - time.monotonic(), 0.1)))
    await asyncio.gather(*workers)
    row = " | ".join(f"{rss_mib(pids[n]):.0f}" for n in names)
    print(f"| {(time.monotonic() - started) / 60:.0f} | {row} | {counts['done']} | {counts['failed']} |")
    print(f"errors by kind: { {k: v for k, v in counts.items() if k not in ('done', 'failed')} }")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    server = NatsServer(auth=True).start()
    log_dir = Path(tempfile.mkdtemp(prefix="switchyard-soak-"))
    stack = Stack(nats_url=server.url, auth_dir=server.auth_dir, api_port=free_port(), num_workers=1, log_dir=log_dir,
                  service_args=["--kv-cache-memory-gib", "0.5", "--threads", str(args.threads)])
    stack.nats = server
    stack.start()
    try:
        stack.wait_ready()
        asyncio.run(soak(stack, args.minutes, args.concurrency, args.sample_s))
    finally:
        stack.stop()
        print(f"logs: {log_dir}")


if __name__ == "__main__":
    main()
