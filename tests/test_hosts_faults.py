"""The stack across hosts (network namespaces on a private bridge; the layout in host_stack.py),
each fault mid-stream at c=16: a NATS node killed, a worker host cut off for 10 s, the scheduler's
host killed, a gateway's host killed. Every accepted request completes with a lone run's greedy
tokens, or ends with an error event within 10 s; none hangs; what JetStream holds survives
(bench/hosts_faults.py repeats them)."""

from __future__ import annotations

import asyncio
import io
import time

import pytest

from tests.conftest import show_logs
from tests.host_stack import Cluster
from tests.hosts import can_make_hosts
from tests.streaming import stream_completion

pytestmark = pytest.mark.stack
CONCURRENCY = 16
MAX_TOKENS = 48
PROMPTS = [f"Tell me {i + 2} things about ships and harbours." for i in range(CONCURRENCY)]
ERROR_WITHIN_S = 10.0
CUT_S = 10.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if (why := can_make_hosts()) is not None:
        pytest.skip(why)
    log_dir = tmp_path_factory.mktemp("hosts")
    c = Cluster(log_dir)
    try:
        c.start()
    except Exception:
        c.stop()
        show_logs(log_dir)
        raise
    yield c
    c.stop()


def _client(base_url: str):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def _stream(client, model: str, prompt: str, started: asyncio.Event) -> tuple[str, str, float]:
    return await stream_completion(client, model, prompt, MAX_TOKENS, started)


@pytest.fixture(scope="module")
def alone(cluster, model_name) -> list[str]:
    async def lone_runs():
        client = _client(cluster.base_url("api-a"))
        return [(await _stream(client, model_name, p, asyncio.Event()))[0] for p in PROMPTS]

    return asyncio.run(lone_runs())


async def _under_fault(cluster, model_name, fault) -> tuple[list[tuple[str, str, float]], float]:
    """16 streams, half through each gateway; `fault()` once all are mid-stream; their ends."""
    clients = [_client(cluster.base_url("api-a")), _client(cluster.base_url("api-b"))]
    started = [asyncio.Event() for _ in PROMPTS]
    streams = [asyncio.create_task(_stream(clients[i % 2], model_name, p, e))
               for i, (p, e) in enumerate(zip(PROMPTS, started, strict=True))]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    at = time.monotonic()
    await fault()
    return await asyncio.wait_for(asyncio.gather(*streams), 240), at


def _check(done, alone, at: float, spared=range(CONCURRENCY)) -> int:
    """Each completed with a lone run's tokens or ended with an error soon; those in `spared` completed."""
    for i, ((text, finish, ended), lone) in enumerate(zip(done, alone, strict=True)):
        assert finish in ("length", "error"), i
        if finish == "length":
            assert text == lone, i
        else:
            assert i not in spared and ended - at < ERROR_WITHIN_S, i
    return sum(finish == "length" for _, finish, _ in done)


async def test_a_nats_node_killed(cluster, alone, model_name):
    openai = pytest.importorskip("openai")
    files = openai.OpenAI(base_url=cluster.base_url("api-b") + "/v1", api_key="unused", max_retries=8, timeout=60)
    kept = files.files.create(file=("kept.jsonl", io.BytesIO(b'{"kept": 1}\n')), purpose="batch")
    node = cluster.nats.nodes[0]

    async def kill_node():
        node.proc.kill()

    done, at = await _under_fault(cluster, model_name, kill_node)
    node.proc.wait()
    node.start()
    cluster.hosts["a"].adopt(node.proc)
    assert _check(done, alone, at) == CONCURRENCY
    assert files.files.content(kept.id).read() == b'{"kept": 1}\n'  # JetStream kept it on the others


async def test_a_worker_host_cut_off_for_10s(cluster, alone, model_name):
    host = cluster.hosts["f"]

    async def cut():
        host.cut()
        await asyncio.sleep(CUT_S)  # the partition's length
        host.heal()

    done, at = await _under_fault(cluster, model_name, cut)
    assert _check(done, alone, at) == CONCURRENCY  # its requests moved to the other worker
    await cluster.until_workers(model_name, 2)  # and it is back


async def test_the_scheduler_host_killed(cluster, alone, model_name):
    leader = await cluster.leader()
    host = cluster.hosts[cluster.services[leader][0]]

    async def kill_host():
        host.kill()

    done, at = await _under_fault(cluster, model_name, kill_host)
    assert _check(done, alone, at) == CONCURRENCY  # the standby took the lease and the streams
    cluster.run(leader)  # back, as the standby now


async def test_a_gateway_host_killed_spares_the_other_gateways_clients(cluster, alone, model_name):
    host = cluster.hosts["b"]  # api-b and a NATS node

    async def kill_host():
        host.kill()

    done, at = await _under_fault(cluster, model_name, kill_host)
    completed = _check(done, alone, at, spared=range(0, CONCURRENCY, 2))  # api-a's clients: every one
    assert completed >= CONCURRENCY // 2
