"""`python -m bench.hosts_faults`: the multi-host faults of tests/test_hosts_faults.py, repeated.

    python -m bench.hosts_faults [--rounds 3 --streams 16 --max-tokens 48]

Seven network-namespace hosts (tests/host_stack.py; needs root). Each round, with `--streams`
streams in flight (half through each gateway): a NATS node killed (-9, then restarted), a worker
host cut off for 10 s, the leader scheduler's host killed (it comes back as the standby). Then,
once, a gateway's host killed. For each fault: streams completed with a lone run's tokens, with
other tokens (lost or doubled tokens), ended with an error, hung; the requests the gateways
re-submitted to a new leader; the longest pause in the tokens after the fault.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time
from pathlib import Path

import openai

from bench.cpu_flags import cpu_name
from tests.host_stack import Cluster
from tests.hosts import can_make_hosts
from tests.streaming import stream_completion

MODEL = "SmolLM2-135M-Instruct"
CUT_S = 10.0


async def _stream(client, prompt: str, max_tokens: int, started: asyncio.Event, times: list[float]):
    text, finish, _ = await stream_completion(client, MODEL, prompt, max_tokens, started, times)
    return text, finish


def _resumed(cluster: Cluster) -> int:
    return sum(len(re.findall('"event": "request_resumed"', p.read_text()))
               for p in cluster.log_dir.glob("api-*.log"))


async def _round(cluster: Cluster, name: str, fault, prompts: list[str], alone: list[str], max_tokens: int) -> dict:
    clients = [openai.AsyncOpenAI(base_url=cluster.base_url(api) + "/v1", api_key="-", max_retries=0, timeout=120)
               for api in ("api-a", "api-b")]
    started, times = [asyncio.Event() for _ in prompts], []
    resumed_before = _resumed(cluster)
    tasks = [asyncio.create_task(_stream(clients[i % 2], p, max_tokens, e, times))
             for i, (p, e) in enumerate(zip(prompts, started, strict=True))]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    at = time.monotonic()
    await fault()
    done, hung = await asyncio.wait(tasks, timeout=240)
    for task in hung:
        task.cancel()
    results = [t.result() if t in done else ("", "hung") for t in tasks]
    after = sorted(t for t in times if t > at)
    pause = max((b - a for a, b in zip([at, *after], after, strict=False)), default=0.0)
    return {"fault": name, "whole": sum(f == "length" and t == lone for (t, f), lone in zip(results, alone, strict=True)),
            "other tokens": sum(f == "length" and t != lone for (t, f), lone in zip(results, alone, strict=True)),
            "error": sum(f == "error" for _, f in results), "hung": len(hung),
            "re-submitted": _resumed(cluster) - resumed_before, "longest pause s": round(pause, 2)}


async def main(args) -> None:
    if (why := can_make_hosts()) is not None:
        raise SystemExit(f"bench.hosts_faults needs network namespaces: {why}")
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="sy-hosts-")))
    try:
        await asyncio.to_thread(cluster.start)  # it waits for JetStream with a loop of its own
        prompts = [f"Tell me {i + 2} things about ships and harbours." for i in range(args.streams)]
        lone_client = openai.AsyncOpenAI(base_url=cluster.base_url("api-a") + "/v1", api_key="-", max_retries=0)
        alone = [(await _stream(lone_client, p, args.max_tokens, asyncio.Event(), []))[0] for p in prompts]

        async def kill_nats():
            node = cluster.nats.nodes[0]
            node.proc.kill()
            node.proc.wait()
            node.start()
            cluster.hosts["a"].adopt(node.proc)

        async def cut_worker():
            cluster.hosts["f"].cut()
            await asyncio.sleep(CUT_S)
            cluster.hosts["f"].heal()

        async def kill_leader():
            leader = await cluster.leader()
            cluster.kill_host(cluster.services[leader][0])
            cluster.run(leader)  # back at once, as the standby

        async def kill_gateway():
            cluster.kill_host("b")

        rows = []
        for _ in range(args.rounds):
            for name, fault in (("NATS node -9", kill_nats), ("worker host cut 10 s", cut_worker),
                                ("leader's host -9", kill_leader)):
                rows.append(await _round(cluster, name, fault, prompts, alone, args.max_tokens))
                await cluster.until_workers(MODEL, 2)
        rows.append(await _round(cluster, "gateway host -9", kill_gateway, prompts, alone, args.max_tokens))
    finally:
        cluster.stop()
    print(f"# {cpu_name()}, {args.streams} streams of {args.max_tokens} tokens")
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    asyncio.run(main(parser.parse_args()))
