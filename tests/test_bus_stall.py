"""A bus that stalls is not a lost request: nats-server paused (SIGSTOP) for 10 s with 8 streams in
flight, on the defaults `make run` picks; every stream resumes and ends with a lone run's tokens."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.conftest import _start_stack
from tests.streaming import stream_completion

pytestmark = pytest.mark.stack
STALL_S = 10.0  # longer than every silence window (2 s scheduler, 5 s worker, 10 s client)
NUM_STREAMS = 8
MAX_TOKENS = 100
PROMPTS = [f"Write a short note about the number {i} and why it matters." for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def stall_stack(tmp_path_factory):
    s = _start_stack(tmp_path_factory, "bus-stall", num_workers=1, extra_args=["--no-deterministic"])
    yield s
    s.stop()


async def _stream(client, model: str, prompt: str, started: asyncio.Event) -> tuple[str, str]:
    text, finish, _ = await stream_completion(client, model, prompt, MAX_TOKENS, started)
    return text, finish


async def test_streams_ride_out_a_paused_bus_and_end_with_their_tokens(stall_stack, model_name):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=stall_stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    alone = []
    for prompt in PROMPTS:
        text, _ = await _stream(client, model_name, prompt, asyncio.Event())
        alone.append(text)

    started = [asyncio.Event() for _ in PROMPTS]
    streams = [asyncio.create_task(_stream(client, model_name, p, e)) for p, e in zip(PROMPTS, started, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)  # all 8 mid-stream
    nats_pid = stall_stack.nats.proc.pid
    os.kill(nats_pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        await asyncio.sleep(STALL_S)  # the fault's length, not a wait for an event
    finally:
        os.kill(nats_pid, signal.SIGCONT)
    assert time.monotonic() - paused_at >= STALL_S
    done = await asyncio.wait_for(asyncio.gather(*streams), 120)
    assert [finish for _, finish in done] == ["length"] * NUM_STREAMS
    assert [text for text, _ in done] == alone
