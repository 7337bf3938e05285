"""The registry's listings against a real nats-server: each key exactly once, even while it changes.

nats-py's KeyValue.keys() lists through a consumer: against nats-server 2.9 it returned an agent
twice when the agent refreshed its entry mid-listing (so pipelines/status counted its replicas
twice), and now and then nothing at all (so a restarted stack listed no models). The registry lists
from a stream-info snapshot instead; these tests hammer both cases.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from shared.control.registry import AgentRecord, ModelVersion, Registry, WorkerState
from switchyard.nats_server import NatsServer

pytestmark = pytest.mark.stack  # starts a nats-server: not part of `make test-fast`
LISTINGS = 200


@pytest.fixture(scope="module")
def nats_url():
    server = NatsServer().start()
    yield server.url
    server.stop()


async def test_an_agent_refreshing_its_entry_is_listed_once(nats_url):
    reader, writer = await nats.connect(nats_url), await nats.connect(nats_url)
    registry, refresher = await Registry(reader).open(), await Registry(writer).open()
    record = AgentRecord(agent_id="host-1", accel="cpu", device_group=None, cpus=8, memory=1 << 30,
                         workers=[WorkerState(worker_id=f"w{i}", deployment="d-1", generation=1, pid=i,
                                              state="running") for i in range(2)])
    stop = asyncio.Event()

    async def refresh():  # far faster than an agent's tick, so listings overlap updates
        while not stop.is_set():
            await refresher.put_agent(record)
            await asyncio.sleep(0.001)

    await refresher.put_agent(record)
    task = asyncio.create_task(refresh())
    try:
        counts = [len(await registry.agent_records()) for _ in range(LISTINGS)]
    finally:
        stop.set()
        await task
        await reader.close()
        await writer.close()
    assert counts == [1] * LISTINGS


async def test_every_model_is_listed_every_time(nats_url):
    nc = await nats.connect(nats_url)
    registry = await Registry(nc).open()
    names = [f"model-{i}" for i in range(20)]
    for name in names:
        await registry.create_version(ModelVersion(name=name, version=0, file_name="m.gguf", sha256="0" * 64,
                                                   size=1, status="ready", created_at=time.time()))

    async def names_listed() -> list[str]:
        return [m.name for m in await registry.models()]

    try:
        listings = []
        for _ in range(100):  # eight at once, as concurrent HTTP requests list them
            listings += await asyncio.gather(*(names_listed() for _ in range(8)))
        versions = await registry.versions("model-1")
    finally:
        await nc.close()
    assert all(listing == sorted(names) for listing in listings)  # sorted by name, none missing, none twice
    assert [v.version for v in versions] == [1]  # a prefix lists its own keys, not model-10's


async def test_a_broken_record_is_skipped_and_wildcard_names_find_nothing(nats_url):
    """A record written by hand (or by an older version) that does not decode never breaks a
    listing or a lookup; a name that is not one clean key token never reaches a key pattern."""
    nc = await nats.connect(nats_url)
    registry = await Registry(nc).open()
    await registry.create_version(ModelVersion(name="good", version=0, file_name="m.gguf", sha256="0" * 64,
                                               size=1, status="ready", created_at=time.time()))
    await registry.kv.put("models.broken.1", b'{"name": "broken", "version": "one"}')  # a mistyped field
    await registry.kv.put("models.broken.2", b"{not json")
    await registry.kv.put("pipelines.broken", b'{"name": 5}')
    try:
        names = [m.name for m in await registry.models()]
        assert "good" in names and "broken" not in names
        assert await registry.version("broken", 2) is None and await registry.pipeline("broken") is None
        assert [p.name for p in await registry.pipelines()] == []
        for wildcard in ("*", ">", "good.*", "a b", "good\n"):
            assert await registry.versions(wildcard) == [] and await registry.pipeline(wildcard) is None
        assert await registry.version("good", "1") is None  # a version is a number
    finally:
        await nc.close()
