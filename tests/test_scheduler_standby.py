"""Two schedulers under a leader lease (JetStream KV): the standby waits; the leader killed with -9
mid-stream at c=16, it takes the lease and every stream resumes and ends with a lone run's tokens."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.scheduler.lease import LEASES_BUCKET
from shared import subjects
from shared.messages import STEP_RESULT_DECODER, Step, encode
from switchyard.launcher import Stack
from switchyard.nats_server import NatsServer, free_port
from tests.conftest import ready_or_stopped
from tests.streaming import stream_completion

pytestmark = pytest.mark.stack
CONCURRENCY = 16
MAX_TOKENS = 48
PROMPTS = [f"Give {i + 2} reasons to visit the mountains." for i in range(CONCURRENCY)]


@pytest.fixture(scope="module")
def standby_stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("standby")
    bus = NatsServer(auth=True).start()
    stack = Stack(nats_url=bus.url, auth_dir=bus.auth_dir, api_port=free_port(), num_workers=1, num_schedulers=2,
                  log_dir=log_dir, service_args=["--kv-cache-memory-gib", "0.4", "--threads", "1",
                                                 "--no-deterministic"])
    stack.nats = bus
    stack.start()
    yield ready_or_stopped(stack, log_dir)
    stack.stop()


async def _leader(stack) -> str:
    """The launched scheduler whose process holds the lease (its holder is host-pid)."""
    nc = await nats.connect(stack.admin_url)
    try:
        holder = (await (await nc.jetstream().key_value(LEASES_BUCKET)).get("scheduler.scheduler")).value.decode()
    finally:
        await nc.close()
    pid = int(holder.rsplit("-", 1)[1])
    return next(s.name for s in stack.services if s.name.startswith("scheduler") and s.proc.pid == pid)


async def _stream(client, model: str, prompt: str, started: asyncio.Event, times: list[float]) -> tuple[str, str]:
    text, finish, _ = await stream_completion(client, model, prompt, MAX_TOKENS, started, times)
    return text, finish


async def test_the_standby_takes_over_a_killed_leaders_streams(standby_stack, model_name):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=standby_stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    alone = [(await _stream(client, model_name, p, asyncio.Event(), []))[0] for p in PROMPTS]

    leader = await _leader(standby_stack)
    standby = next(s.name for s in standby_stack.services if s.name.startswith("scheduler") and s.name != leader)
    started, times = [asyncio.Event() for _ in PROMPTS], []
    streams = [asyncio.create_task(_stream(client, model_name, p, e, times))
               for p, e in zip(PROMPTS, started, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)  # all 16 mid-stream
    standby_stack.service(leader).proc.kill()
    killed_at = time.monotonic()
    done = await asyncio.wait_for(asyncio.gather(*streams), 180)
    assert [finish for _, finish in done] == ["length"] * CONCURRENCY
    assert [text for text, _ in done] == alone  # resumed where they were, no token lost or doubled
    assert await _leader(standby_stack) == standby
    after = sorted(t for t in times if t > killed_at)
    gap = max((b - a for a, b in zip([killed_at, *after], after, strict=False)), default=0.0)
    print(f"takeover: the longest pause in the tokens after the kill was {gap:.2f}s")
    assert (standby_stack.log_dir / "api.log").read_text().count('"event": "request_resumed"') == CONCURRENCY


async def test_a_worker_refuses_a_step_from_a_deposed_leader(standby_stack, model_name):
    """The worker has seen the leader's token (1 or more): a Step with a lower one (0) is refused
    as fenced, as a deposed leader's would be, and the worker goes on serving the leader."""
    nc = await nats.connect(standby_stack.admin_url)
    try:
        stale = Step(step_id=10**9, fence=0)
        result = STEP_RESULT_DECODER.decode((await nc.request(subjects.worker_step("worker-0"), encode(stale),
                                                                timeout=10)).data)
    finally:
        await nc.close()
    assert result.fenced and "leads" in result.error
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=standby_stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    answer = await client.completions.create(model=model_name, prompt="Hi", max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop")
