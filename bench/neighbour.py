"""`python -m bench.neighbour`: what busy neighbour processes cost a stack, at each worker niceness.

    python -m bench.neighbour [--nice 10,0] [--rounds 2]

For each `--nice`, a stack of its own (one worker, `make run`'s defaults otherwise): 32 greedy
streams of 64 tokens on a quiet host, then 8 beside one `while True` process per core. Prints the
wall time of each and the longest wait between two tokens of a stream.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import openai

from bench.cpu_flags import cpu_name
from switchyard.launcher import Stack
from switchyard.nats_server import NatsServer, free_port

MODEL = "SmolLM2-135M-Instruct"


async def streams(base_url: str, num: int, busy: int) -> tuple[float, float]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="-", timeout=600, max_retries=0)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    gaps = []

    async def one(i: int) -> None:
        last, gap = time.monotonic(), 0.0
        chunks = await client.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=64, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for _ in chunks:
            now = time.monotonic()
            gap, last = max(gap, now - last), now
        gaps.append(gap)

    try:
        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(num)))
        return time.monotonic() - started, max(gaps)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nice", default="10,0")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"on {cpu_name()}", flush=True)
    for nice in args.nice.split(","):
        bus = NatsServer(auth=True).start()
        stack = Stack(nats_url=bus.url, auth_dir=bus.auth_dir, api_port=free_port(), num_workers=1,
                      service_args=["--nice", nice, "--kv-cache-memory-gib", "0.5"])
        stack.nats = bus
        stack.start()
        try:
            stack.wait_ready()
            for _ in range(args.rounds):
                for num, busy in ((32, 0), (8, os.cpu_count() or 2)):
                    took, gap = asyncio.run(streams(stack.base_url, num, busy))
                    print(f"| --nice {nice} | {num}x64 tokens, {busy} busy processes | {took:.1f} s | "
                          f"longest gap {gap:.2f} s |", flush=True)
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
