"""`python -m bench.disagg`: decode streams' inter-token latency while long prompts arrive, with
prefill and decode on workers of their own (--prefill-workers 1 --decode-workers 1) and colocated
(--workers 2), each worker pinned to a core of its own; "two hosts": the decode worker on a host of
its own (a network namespace, its own host tier: the bus reached over a veth pair and a bridge, as
tests/hosts.py makes them; without root, the same process on this host's network), so each handoff
copies its blocks over the bus between two network stacks.

    python -m bench.disagg [--streams 4 --stream-tokens 384 --prompt 4096]
    python -m bench.disagg --layouts "disaggregated,two hosts"

Each layout runs two phases: the decode streams alone, then the same streams while a client sends
long prompts one after another until they end. Reported per phase: the streams' gaps between
chunks (p50, p99) and their TPOT (mean over the streams); the ratio of the second phase's to the
first's is what a decode stream feels of prompts arriving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from bench.client import LoadSpec, send
from bench.cpu_flags import cpu_name
from bench.dataset import Prompt
from switchyard.launcher import Stack
from switchyard.nats_server import NatsServer, free_port
from tests.hosts import Hosts, can_make_hosts


def _pin(stack: Stack, names: list[str]) -> None:
    """Each named worker on a core of its own (every thread of it), core 0 first; the rest of the
    stack (gateway, scheduler, KV index, agent, nats-server) on core 0, so the second worker's core
    is its own as a host's would be."""
    others = [s.proc.pid for s in stack.services if s.name not in names] + [stack.nats.proc.pid]
    for core, pids in [(0, others)] + [(core, [stack.service(name).proc.pid]) for core, name in enumerate(names)]:
        for pid in pids:
            subprocess.run(["taskset", "-a", "-cp", str(core), str(pid)], check=True, capture_output=True)


async def phase(spec: LoadSpec, args: argparse.Namespace, with_prompts: bool, rng: random.Random) -> dict:
    streams = [Prompt([rng.randrange(100, 40000) for _ in range(32)], 32, args.stream_tokens)
               for _ in range(args.streams)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        decoding = [asyncio.create_task(send(session, spec, p)) for p in streams]
        long_ttfts = []
        if with_prompts:
            await asyncio.sleep(args.lead_s)  # the streams are decoding when the first prompt arrives
            while not all(t.done() for t in decoding):
                long = Prompt([rng.randrange(100, 40000) for _ in range(args.prompt)], args.prompt, 8)
                long_ttfts.append((await send(session, spec, long)).ttft)
        results = await asyncio.gather(*decoding)
    assert all(r.ok for r in results), [r.error for r in results]
    gaps = sorted(g for r in results for g in r.itl)
    tpots = sorted(r.tpot for r in results)
    return {"p50": statistics.median(gaps), "p99": gaps[int(0.99 * (len(gaps) - 1))], "max": gaps[-1],
            "tpot": statistics.mean(tpots), "tpot_p99": tpots[int(0.99 * (len(tpots) - 1) + 0.5)],
            "prompts": len(long_ttfts), "prompt_ttft": statistics.median(long_ttfts) if long_ttfts else 0.0}


def _decode_host(stack: Stack, root: Path, host: Path, wrapper: list[str]) -> None:
    """A decode worker whose tier is another folder of /dev/shm than the prefill worker's (another
    host's shared memory), run under `wrapper` (its host's network namespace): the launcher starts the
    prefill worker, this one is started beside it."""
    decode = stack.add_worker("worker-decode-0", "--kv-offloading-dir", str(host),
                              "--kv-transfer-config", json.dumps({"kv_role": "kv_consumer"}), wrapper=wrapper)
    deadline = time.monotonic() + 300
    while '"worker_id": "worker-decode-0"' not in (root / "scheduler.log").read_text():  # its hello, taken
        assert time.monotonic() < deadline and decode.proc.poll() is None, "the decode worker did not join"
        time.sleep(0.5)


def run(layout: str, args: argparse.Namespace) -> dict:
    # "two hosts": the bus listens on the bridge's address, which this host and host b's namespace reach
    netns = Hosts(["b"]).make() if layout == "two hosts" and can_make_hosts() is None else None
    bus = NatsServer(auth=True, host=f"{netns.subnet}.1" if netns else "127.0.0.1").start()
    flags = ["--threads", "1", "--max-model-len", str(args.prompt + 64), "--kv-cache-memory-gib", "1",
             "--kv-offloading-size", "2"]
    disaggregated, two_hosts = layout == "disaggregated", layout == "two hosts"
    root = Path(tempfile.mkdtemp(prefix="sy-disagg-"))  # the services' logs
    hosts = Path(tempfile.mkdtemp(prefix="sy-hosts-", dir="/dev/shm"))  # two hosts' shared memory
    for host in ("a", "b"):
        (hosts / host).mkdir()
    stack = Stack(nats_url=bus.url, auth_dir=bus.auth_dir, api_port=free_port(), log_dir=root,
                  service_args=[*flags, "--kv-offloading-dir", str(hosts / "a")] if two_hosts else flags,
                  num_workers=0 if disaggregated or two_hosts else 2,
                  num_prefill_workers=int(disaggregated or two_hosts), num_decode_workers=int(disaggregated))
    stack.nats = bus
    stack.start()
    try:
        stack.wait_ready()
        if two_hosts:
            _decode_host(stack, root, hosts / "b", netns["b"].wrapper if netns else [])
        _pin(stack, ["worker-prefill-0", "worker-decode-0"] if disaggregated or two_hosts else ["worker-0", "worker-1"])
        model = httpx.get(f"{stack.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        spec = LoadSpec(base_url=stack.base_url, model=model)
        rng = random.Random(0)
        return {"alone": asyncio.run(phase(spec, args, False, rng)),
                "prompts arriving": asyncio.run(phase(spec, args, True, rng))}
    finally:
        stack.stop()
        shutil.rmtree(hosts, ignore_errors=True)
        if netns:
            netns.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4, help="decode streams (32-token prompts)")
    parser.add_argument("--stream-tokens", type=int, default=384, help="tokens each stream decodes")
    parser.add_argument("--prompt", type=int, default=4096, help="the arriving prompts' length, in tokens")
    parser.add_argument("--lead-s", type=float, default=2.0, help="the streams' head start before the first prompt")
    parser.add_argument("--layouts", default="colocated,disaggregated",
                        help='comma-separated: colocated, disaggregated, "two hosts"')
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})  # the load generator too: the second core is the second worker's alone
    print(f"{cpu_name()}; {args.streams} decode streams of {args.stream_tokens} tokens; prompts of {args.prompt} "
          "tokens (8 tokens each) sent one after another in the second phase; every worker --threads 1, on a "
          "core of its own, the rest of the stack on the first worker's; \"two hosts\": the decode worker "
          + ("in a network namespace of its own" if can_make_hosts() is None else "on this host's network (no root)"))
    print("| layout | phase | streams' TPOT p99 / mean (ms) | gaps between chunks p50 / p99 / max (ms) "
          "| prompts served | their TTFT p50 (s) |")
    print("|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        phases = run(layout, args)
        for name, m in phases.items():
            print(f"| {layout} | {name} | {m['tpot_p99'] * 1e3:.1f} / {m['tpot'] * 1e3:.1f} | {m['p50'] * 1e3:.1f} / "
                  f"{m['p99'] * 1e3:.1f} / {m['max'] * 1e3:.0f} | {m['prompts']} | {m['prompt_ttft']:.2f} |")
        alone, busy = phases["alone"], phases["prompts arriving"]
        print(f"| {layout} | ratio | {busy['tpot_p99'] / alone['tpot_p99']:.2f}x / {busy['tpot'] / alone['tpot']:.2f}x | "
              f"{busy['p50'] / alone['p50']:.2f}x / {busy['p99'] / alone['p99']:.2f}x / {busy['max'] / alone['max']:.1f}x"
              " | | |")


if __name__ == "__main__":
    main()
