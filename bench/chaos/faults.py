"""The faults a platform meets, each done to the running stack as it would happen there, and the
schedules that inject them (random, or fixed for CI)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from bench.chaos.load import MODEL, SHARED_PREFIX
from bench.chaos.stack import ChaosStack

WORKER_STOP_S = 15.0
BUS_STOP_S = 8.0
NEIGHBOUR_S = 30.0  # three leases (scheduler/lease.py's LEASE_S) and thirty heartbeats long
SQUEEZE_REQUESTS = 12  # long prompts at once: more KV than the pools hold, so running requests are preempted
SQUEEZE_TRIES = 3  # a squeeze request cut by a gateway's kill is sent again on the other gateway


@dataclass
class Fault:
    kind: str
    at: float  # monotonic, when it was done
    target: str = ""
    duration_s: float = 0.0  # how long the fault itself lasted (a stop, a neighbour)


async def worker_kill(stack: ChaosStack, rng: random.Random) -> Fault:
    """SIGKILL the busier worker; the launcher restarts it and it rejoins while its requests stream elsewhere."""
    name = await stack.busiest_worker(rng)
    fault = Fault("worker_kill", time.monotonic(), name)
    stack.signal(name, signal.SIGKILL)
    return fault


async def worker_stop(stack: ChaosStack, rng: random.Random) -> Fault:
    """A worker paused (a GC pause, a VM migration) for WORKER_STOP_S: declared gone, then back."""
    name = await stack.busiest_worker(rng)
    return await _stopped(stack, "worker_stop", [name], WORKER_STOP_S)


async def workers_stop(stack: ChaosStack, rng: random.Random) -> Fault:
    """Every worker of the model paused for WORKER_STOP_S: its requests wait for the first one back."""
    return await _stopped(stack, "workers_stop", stack.worker_names, WORKER_STOP_S)


async def leader_kill(stack: ChaosStack, rng: random.Random) -> Fault:
    """SIGKILL the leading scheduler: the standby takes the lease, the gateways re-submit."""
    name = await stack.leader()
    fault = Fault("leader_kill", time.monotonic(), name)
    stack.signal(name, signal.SIGKILL)
    return fault


async def nats_node_kill(stack: ChaosStack, rng: random.Random) -> Fault:
    """SIGKILL one node of the NATS cluster; the launcher starts it again on its store."""
    node = rng.choice(stack.stack.nats.nodes)
    fault = Fault("nats_node_kill", time.monotonic(), node.cluster.name)
    with stack.lock:
        node.proc.kill()
        node.proc.wait()
    return fault


async def bus_stop(stack: ChaosStack, rng: random.Random) -> Fault:
    """The whole bus paused for BUS_STOP_S (every node SIGSTOPped): TCP stays open, nothing moves."""
    nodes = stack.stack.nats.nodes
    fault = Fault("bus_stop", time.monotonic(), "all nodes", BUS_STOP_S)
    for node in nodes:
        os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(BUS_STOP_S)
    finally:
        for node in nodes:
            os.kill(node.proc.pid, signal.SIGCONT)
    return fault


async def gateway_kill(stack: ChaosStack, rng: random.Random) -> Fault:
    """SIGKILL one gateway: its clients' connections drop (they retry on the other); the launcher restarts it."""
    name = rng.choice(stack.gateway_names)
    fault = Fault("gateway_kill", time.monotonic(), name)
    stack.signal(name, signal.SIGKILL)
    return fault


async def kv_squeeze(stack: ChaosStack, rng: random.Random) -> Fault:
    """More long requests at once than the KV pools hold: preemption storms under the steady load.
    They are greedy, so each must also equal its lone run (checked like the load's)."""
    fault = Fault("kv_squeeze", time.monotonic(), f"{SQUEEZE_REQUESTS} long prompts")
    prompt = SHARED_PREFIX * 12
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 96, "temperature": 0, "ignore_eos": True}
    first = rng.randrange(2)
    answers = await asyncio.gather(*(_post_on_a_live_gateway(stack, body, first) for _ in range(SQUEEZE_REQUESTS)),
                                   return_exceptions=True)
    texts = {a.json()["choices"][0]["text"] for a in answers if isinstance(a, httpx.Response) and a.status_code == 200}
    fault.duration_s = time.monotonic() - fault.at
    fault.target += f", {len(texts)} distinct answers"  # one: every preempted request recomputed the same tokens
    stack.squeeze_answers.append((len(texts), sum(isinstance(a, httpx.Response) and a.status_code == 200
                                                  for a in answers)))
    return fault


async def _post_on_a_live_gateway(stack: ChaosStack, body: dict, first: int) -> httpx.Response:
    """A completion sent as the load's clients send one: where a gateway drops the connection (a
    gateway_kill while it runs, on a slow host), again from the start on the other one."""
    for attempt in range(SQUEEZE_TRIES):
        async with httpx.AsyncClient(base_url=stack.stack.gateway_url((first + attempt) % 2), timeout=300) as http:
            try:
                return await http.post("/v1/completions", json=body)
            except httpx.TransportError:
                if attempt == SQUEEZE_TRIES - 1:
                    raise
                await asyncio.sleep(0.5)  # as a client backs off before it retries
    raise AssertionError("unreachable")


async def noisy_neighbour(stack: ChaosStack, rng: random.Random) -> Fault:
    """Processes that take every core for NEIGHBOUR_S: a shared host is the normal case."""
    fault = Fault("noisy_neighbour", time.monotonic(), f"{os.cpu_count()} busy processes", NEIGHBOUR_S)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        await asyncio.sleep(NEIGHBOUR_S)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    return fault


async def _stopped(stack: ChaosStack, kind: str, names: list[str], seconds: float) -> Fault:
    fault = Fault(kind, time.monotonic(), ",".join(names), seconds)
    for name in names:
        stack.signal(name, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        for name in names:
            stack.signal(name, signal.SIGCONT)
    return fault


FAULTS = {f.__name__: f for f in (worker_kill, worker_stop, workers_stop, leader_kill, nats_node_kill, bus_stop,
                                  gateway_kill, kv_squeeze, noisy_neighbour)}
# CI's schedule: every kind once in FIXED_MINUTES, the restart path first (seconds after the load starts),
# each kill 18 s or more after the last (a lease, LEASE_S, is 10 s) and the pauses on their own
FIXED = [(5, "worker_kill"), (20, "kv_squeeze"), (30, "noisy_neighbour"), (40, "leader_kill"), (58, "nats_node_kill"),
         (76, "worker_stop"), (98, "bus_stop"), (112, "gateway_kill"), (122, "workers_stop")]
FIXED_MINUTES = 2.4  # the last fault's 15 s, then the load for 7 s more


def random_schedule(minutes: float, rng: random.Random) -> list[tuple[float, str]]:
    """A fault every 15-40 s, of a kind drawn at random, from 10 s into the load."""
    at, out = 10.0, []
    while at < minutes * 60 - 20:
        out.append((at, rng.choice(list(FAULTS))))
        at += rng.uniform(15, 40)
    return out


async def inject(stack: ChaosStack, schedule: list[tuple[float, str]], rng: random.Random, started: float,
                 done: list[Fault]) -> None:
    """Each fault at its time; one that lasts (a pause, a neighbour) may overlap the next."""
    running = []
    for at, kind in schedule:
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        print(f"[chaos] {time.monotonic() - started:6.1f}s {kind}", flush=True)
        running.append(asyncio.create_task(FAULTS[kind](stack, rng)))
        running[-1].add_done_callback(lambda task: done.append(task.result()) if not task.exception() else None)
    for fault in await asyncio.gather(*running, return_exceptions=True):
        if isinstance(fault, BaseException):
            raise fault
