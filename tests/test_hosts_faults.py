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


async def _stream(client, model: str, prompt: str, started: asyncio.Event,
                  errors: list[str] | None = None) -> tuple[str, str, float]:
    return await stream_completion(client, model, prompt, MAX_TOKENS, started, errors=errors)


@pytest.fixture(scope="module")
def alone(cluster, model_name) -> list[str]:
    async def lone_runs():
        client = _client(cluster.base_url("api-a"))
        return [(await _stream(client, model_name, p, asyncio.Event()))[0] for p in PROMPTS]

    return asyncio.run(lone_runs())


class Outcome(list):
    """The streams' (text, finish, ended) in order, the errors' words, and when the fault came."""

    def __init__(self, done, errors: list[str], at: float):
        super().__init__(done)
        self.errors, self.at = errors, at


async def _under_fault(cluster, model_name, fault) -> Outcome:
    """16 streams, half through each gateway; `fault()` once all are mid-stream; their ends."""
    clients = [_client(cluster.base_url("api-a")), _client(cluster.base_url("api-b"))]
    started = [asyncio.Event() for _ in PROMPTS]
    errors: list[str] = []
    streams = [asyncio.create_task(_stream(clients[i % 2], model_name, p, e, errors))
               for i, (p, e) in enumerate(zip(PROMPTS, started, strict=True))]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    at = time.monotonic()
    await fault()
    return Outcome(await asyncio.wait_for(asyncio.gather(*streams), 240), errors, at)


def _check(cluster, done: Outcome, alone, spared=range(CONCURRENCY)) -> int:
    """Each completed with a lone run's tokens or ended with an error soon; those in `spared` completed.
    A failure prints the errors' words and the services' logs."""
    try:
        for i, ((text, finish, ended), lone) in enumerate(zip(done, alone, strict=True)):
            assert finish in ("length", "error"), i
            if finish == "length":
                assert text == lone, i
            else:
                assert i not in spared and ended - done.at < ERROR_WITHIN_S, (i, ended - done.at, done.errors[:2])
    except AssertionError:
        show_logs(cluster.log_dir)
        raise
    return sum(finish == "length" for _, finish, _ in done)


async def test_a_nats_node_killed(cluster, alone, model_name):
    openai = pytest.importorskip("openai")
    files = openai.OpenAI(base_url=cluster.base_url("api-b") + "/v1", api_key="unused", max_retries=8, timeout=60)
    kept = files.files.create(file=("kept.jsonl", io.BytesIO(b'{"kept": 1}\n')), purpose="batch")
    node = cluster.nats.nodes[0]

    async def kill_node():
        node.proc.kill()

    done = await _under_fault(cluster, model_name, kill_node)
    node.proc.wait()
    node.start()
    cluster.hosts["a"].adopt(node.proc)
    assert _check(cluster, done, alone) == CONCURRENCY
    assert files.files.content(kept.id).read() == b'{"kept": 1}\n'  # JetStream kept it on the others


async def test_a_worker_host_cut_off_for_10s(cluster, alone, model_name):
    host = cluster.hosts["f"]

    async def cut():
        host.cut()
        await asyncio.sleep(CUT_S)  # the partition's length
        host.heal()

    done = await _under_fault(cluster, model_name, cut)
    assert _check(cluster, done, alone) == CONCURRENCY  # its requests moved to the other worker
    await cluster.until_workers(model_name, 2)  # and it is back


async def test_the_scheduler_host_killed(cluster, alone, model_name):
    leader = await cluster.leader()

    async def kill_host():
        cluster.kill_host(cluster.services[leader][0])

    try:
        done = await _under_fault(cluster, model_name, kill_host)
        assert _check(cluster, done, alone) == CONCURRENCY  # the standby took the lease and the streams
    finally:
        cluster.run(leader)  # back, as the standby now


async def test_a_gateway_host_killed_spares_the_other_gateways_clients(cluster, alone, model_name):
    async def kill_host():
        cluster.kill_host("b")  # api-b and a NATS node

    done = await _under_fault(cluster, model_name, kill_host)
    completed = _check(cluster, done, alone, spared=range(0, CONCURRENCY, 2))  # api-a's clients: every one
    assert completed >= CONCURRENCY // 2
