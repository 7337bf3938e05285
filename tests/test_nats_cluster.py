"""The stack on a three-node NATS cluster (JetStream clustered, every store at replication 3): a
node killed with -9 mid-stream at c=16 loses no accepted request, and the stores outlive it."""

from __future__ import annotations

import asyncio
import io
import time

import nats
import pytest

from shared.bus import servers
from shared.registry import AGENTS_BUCKET, ARTIFACTS_BUCKET, REGISTRY_BUCKET
from switchyard.launcher import Stack
from switchyard.nats_server import NatsCluster, free_port
from tests.conftest import ready_or_stopped
from tests.streaming import stream_completion

pytestmark = pytest.mark.stack
CONCURRENCY = 16
MAX_TOKENS = 48
PROMPTS = [f"List {i + 2} facts about rivers and lakes." for i in range(CONCURRENCY)]
ERROR_WITHIN_S = 10.0  # a request the fault ends must end with an error event this soon after it


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory):
    """As `make run ARGS="--nats-cluster 3"` starts it: the launcher's own cluster, on a store of its own."""
    log_dir = tmp_path_factory.mktemp("nats-cluster")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SY_NATS_STORE_DIR", str(log_dir / "store"))
        stack = Stack(api_port=free_port(), num_workers=1, log_dir=log_dir, nats_cluster=3,
                      service_args=["--kv-cache-memory-gib", "0.4", "--threads", "1", "--no-deterministic"])
        stack.start()
    assert isinstance(stack.nats, NatsCluster) and stack.nats_replicas == 3
    yield ready_or_stopped(stack, log_dir)
    stack.stop()


async def _admin(stack) -> nats.aio.client.Client:
    return await nats.connect(servers(stack.admin_url), max_reconnect_attempts=-1, reconnect_time_wait=0.1)


async def _stream(client, model: str, prompt: str, started: asyncio.Event) -> tuple[str, str, float]:
    return await stream_completion(client, model, prompt, MAX_TOKENS, started)


def _clients(stack):
    openai = pytest.importorskip("openai")
    return (openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60),
            openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120))


async def test_every_store_is_kept_on_three_nodes(cluster_stack, model_name):
    openai_client, _ = _clients(cluster_stack)
    openai_client.files.create(file=("probe.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
    openai_client.responses.create(model=model_name, input="Hi", max_output_tokens=4)  # stored: the Responses store
    nc = await _admin(cluster_stack)
    try:
        js = nc.jetstream()
        print(sorted([s.config.name for s in await js.streams_info()]))
        for stream in (f"KV_{REGISTRY_BUCKET}", f"KV_{AGENTS_BUCKET}", f"OBJ_{ARTIFACTS_BUCKET}", "OBJ_SY_FILES",
                       "SY_RESPONSES"):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, stream
            assert len(info.cluster.replicas or []) == 2, stream  # the leader and two followers
    finally:
        await nc.close()


async def test_a_node_killed_mid_stream_loses_no_accepted_request(cluster_stack, model_name):
    sync_client, client = _clients(cluster_stack)
    uploaded = sync_client.files.create(file=("kept.jsonl", io.BytesIO(b'{"kept": true}\n')),
                                                      purpose="batch")
    alone = [(await _stream(client, model_name, p, asyncio.Event()))[0] for p in PROMPTS]

    gateway_node = next(n for n in cluster_stack.nats.nodes if "api" in n.connections())
    started = [asyncio.Event() for _ in PROMPTS]
    streams = [asyncio.create_task(_stream(client, model_name, p, e)) for p, e in zip(PROMPTS, started, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)  # all 16 mid-stream
    gateway_node.proc.kill()  # the node the gateway is on: it reconnects to another and asks for what it missed
    killed_at = time.monotonic()
    try:
        done = await asyncio.wait_for(asyncio.gather(*streams), 180)
    finally:
        gateway_node.proc.wait()
        gateway_node.start()  # the cluster whole again for what follows
    for (text, finish, ended_at), lone in zip(done, alone, strict=True):
        assert finish in ("length", "error")
        if finish == "length":
            assert text == lone  # completed: a lone run's greedy tokens
        else:
            assert ended_at - killed_at < ERROR_WITHIN_S  # or ended, with an error event, soon
    assert sum(finish == "length" for _, finish, _ in done) == CONCURRENCY  # here every one completes

    openai = pytest.importorskip("openai")  # as a user reads it: a 503 (JetStream electing a leader) is retried
    patient = openai.OpenAI(base_url=cluster_stack.base_url + "/v1", api_key="unused", max_retries=8, timeout=60)
    content = patient.files.content(uploaded.id).read()
    assert content == b'{"kept": true}\n'  # the Files store outlived the node
