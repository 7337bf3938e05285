"""`python -m bench.faults`: the operator's probes, on a stack of its own (two workers, a locked bus).

    python -m bench.faults [--streams 8 --outages 3,5,10]

- worker SIGKILL: `--streams` streams in flight over two workers, one worker killed; each stream
  is counted as finished (whole), lost (ended with an error) or hung (no end within 120 s), and
  the scheduler's count of requests moved to the survivor is shown. The worker is restarted.
- scheduler SIGKILL: seconds from the kill to the in-flight stream's error event; then it is
  restarted and the seconds until a request is served again.
- NATS down for each of `--outages` seconds: streams in flight, then counted the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import nats
import openai

from shared.wire import subjects
from shared.wire.messages import encode
from shared.wire.stats import SCHEDULER_STATS_DECODER, SchedulerStatsRequest
from switchyard.launcher import Stack
from switchyard.nats_server import NatsServer, free_port

MODEL = "SmolLM2-135M-Instruct"


async def scheduler_stats(stack: Stack):
    nc = await nats.connect(stack.admin_url)
    try:
        msg = await nc.request(subjects.scheduler_stats(MODEL), encode(SchedulerStatsRequest()), timeout=2)
        return SCHEDULER_STATS_DECODER.decode(msg.data)
    finally:
        await nc.close()


async def wait_workers(stack: Stack, num: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while (await scheduler_stats(stack)).num_workers < num:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{num} workers never joined")
        await asyncio.sleep(0.2)


async def stream(client: openai.AsyncOpenAI, i: int, max_tokens: int, started: asyncio.Queue) -> str:
    """'whole', 'lost' or 'hung' for one streamed completion."""
    try:
        async with asyncio.timeout(120):
            chunks = await client.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=max_tokens,
                                                     stream=True, extra_body={"ignore_eos": True})
            num, reason = 0, None
            async for chunk in chunks:
                if num == 0:
                    started.put_nowait(i)
                num += 1
                reason = chunk.choices[0].finish_reason or reason
            return "whole" if reason == "length" else "lost"
    except TimeoutError:
        return "hung"
    except openai.APIError:
        return "lost"


async def in_flight(client, num: int, max_tokens: int, fault) -> dict[str, int]:
    started: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(stream(client, i, max_tokens, started)) for i in range(num)]
    for _ in range(num):
        await started.get()
    await fault()
    results = await asyncio.gather(*tasks)
    return {k: results.count(k) for k in ("whole", "lost", "hung")}


async def probe(stack: Stack, streams: int, outages: list[float]) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=150)

    async def kill_worker():
        stack.service("worker-0").proc.kill()

    counts = await in_flight(client, streams, 160, kill_worker)
    moved = (await scheduler_stats(stack)).num_migrations
    print(f"| worker SIGKILL, {streams} streams | finished {counts['whole']} ({moved} of them moved to the survivor) "
          f"| lost {counts['lost']} | hung {counts['hung']} |", flush=True)
    stack.service("worker-0").start(stack._env("worker-0"))

    started: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(stream(client, 99, 4000, started))
    await started.get()
    killed = time.monotonic()
    stack.service("scheduler").proc.kill()
    outcome = await task
    to_error = time.monotonic() - killed
    stack.service("scheduler").start(stack._env("scheduler"))
    await asyncio.to_thread(stack.wait_ready)
    back = time.monotonic() - killed
    print(f"| scheduler SIGKILL | stream {outcome} after {to_error:.2f} s | served again {back:.1f} s after the kill |",
          flush=True)
    await asyncio.to_thread(stack.wait_ready)

    for outage in outages:
        async def cut(outage=outage):
            stack.nats.proc.kill()
            stack.nats.proc.wait()
            await asyncio.sleep(outage)
            stack.nats.start()

        counts = await in_flight(client, streams, 48, cut)
        print(f"| NATS down {outage:g} s, {streams} streams | finished {counts['whole']} | lost {counts['lost']} | "
              f"hung {counts['hung']} |", flush=True)
        await asyncio.to_thread(stack.wait_ready)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--outages", default="3,5,10")
    args = parser.parse_args()
    server = NatsServer(auth=True).start()
    log_dir = Path(tempfile.mkdtemp(prefix="switchyard-faults-"))
    stack = Stack(nats_url=server.url, auth_dir=server.auth_dir, api_port=free_port(), num_workers=2, log_dir=log_dir,
                  service_args=["--kv-cache-memory-gib", "0.4", "--threads", "1"])
    stack.nats = server
    stack.start()
    try:
        stack.wait_ready()
        asyncio.run(wait_workers(stack, 2))  # /health needs one; the probe needs a survivor
        asyncio.run(probe(stack, args.streams, [float(x) for x in args.outages.split(",")]))
    finally:
        stack.stop()
        print(f"logs: {log_dir}")


if __name__ == "__main__":
    main()
