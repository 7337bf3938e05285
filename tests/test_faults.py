"""Services die and the bus goes away mid-load: nothing hangs, nothing accepted is lost in silence.

One stack of real processes for the module; each test leaves it whole again (it restarts what it kills).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import nats
import pytest

from shared.client import BusClient
from shared.messages import SamplingParams
from tests.bus_helpers import scheduler_stats

pytestmark = pytest.mark.stack
LONG = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}  # runs until something ends it


@pytest.fixture(scope="module")
def fault_stack(tmp_path_factory):
    from tests.conftest import _start_stack

    s = _start_stack(tmp_path_factory, "faults", num_workers=1, extra_args=[])
    yield s
    s.stop()


@pytest.fixture
def client(fault_stack):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=fault_stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def test_a_dead_schedulers_requests_end_with_an_error_and_new_ones_flow_once_it_is_back(
        fault_stack, client, model_name):
    openai = pytest.importorskip("openai")
    stream = await client.completions.create(model=model_name, prompt="Tell me a long story.", stream=True, **LONG)
    first = await stream.__anext__()
    assert first.choices[0].text is not None

    async def non_streaming():
        async with httpx.AsyncClient(base_url=fault_stack.base_url, timeout=60) as http:
            return await http.post("/v1/completions", json={"model": model_name, "prompt": "Another story.",
                                                            "max_tokens": 4000, "ignore_eos": True})

    plain = asyncio.create_task(non_streaming())
    watcher = await nats.connect(fault_stack.admin_url)
    deadline = time.monotonic() + 30
    while (await scheduler_stats(watcher, model_name)).num_running < 2:  # the plain request is in flight too
        assert time.monotonic() < deadline, "the plain request never started"
        await asyncio.sleep(0.05)
    await watcher.close()
    killed_at = time.monotonic()
    fault_stack.service("scheduler").proc.kill()
    with pytest.raises(openai.APIError, match="scheduler holding this request stopped"):
        async for _ in stream:
            pass
    stream_ended_s = time.monotonic() - killed_at
    resp = await plain
    assert resp.status_code == 503 and "scheduler holding this request stopped" in resp.json()["error"]["message"]
    print(f"scheduler SIGKILL: stream error after {stream_ended_s:.2f}s")  # docs/benchmarks.md reports it
    fault_stack.service("scheduler").start(fault_stack._env("scheduler"))
    await asyncio.to_thread(fault_stack.wait_ready, 120)
    done = await client.completions.create(model=model_name, prompt="Hello", max_tokens=4)
    assert done.usage.completion_tokens == 4


async def test_a_silent_clients_requests_are_aborted(fault_stack, model_name):
    """A gateway that dies stops heartbeating; its scheduler aborts what it had submitted."""
    nc = await nats.connect(fault_stack.admin_url)
    gateway = BusClient(nc)
    await gateway.start()
    stream = await gateway.submit(model_name, [100 + i for i in range(16)],
                                  SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))
    first = await stream.entries(timeout=60).__anext__()
    assert first.finish_reason is None
    await gateway.stop()  # no more heartbeats, as if its process had died
    await nc.close()
    watcher = await nats.connect(fault_stack.admin_url)
    deadline = time.monotonic() + 30
    while (await scheduler_stats(watcher, model_name)).num_running:
        assert time.monotonic() < deadline, "the silent client's request kept running"
        await asyncio.sleep(0.2)
    await watcher.close()


@pytest.mark.parametrize("outage_s", [10.0])
async def test_requests_on_live_workers_survive_a_nats_restart(fault_stack, client, model_name, outage_s):
    """Every service loses the bus for outage_s; the in-flight streams then finish whole."""
    max_tokens = 40
    started = asyncio.Event()
    num_started = 0

    async def one(i: int) -> tuple[str, str | None, int]:
        nonlocal num_started
        stream = await client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": f"Count from {i} upwards."}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, reason, usage = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                if not text and chunk.choices[0].delta.content:
                    num_started += 1
                    if num_started == 8:
                        started.set()
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, reason, usage

    requests = [asyncio.create_task(one(i)) for i in range(8)]
    await started.wait()
    fault_stack.nats.proc.kill()
    fault_stack.nats.proc.wait()
    await asyncio.sleep(outage_s)  # the outage itself
    fault_stack.nats.start()
    results = await asyncio.gather(*requests, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert all(reason == "length" and usage == max_tokens for _, reason, usage in results), results
    await asyncio.to_thread(fault_stack.wait_ready, 120)
