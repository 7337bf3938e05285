"""Services die and the bus goes away mid-load: nothing hangs, nothing accepted is lost in silence.

One stack of real processes for the module; each test leaves it whole again (it restarts what it kills).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import nats
import pytest

from shared.bus.client import BusClient
from shared.wire.messages import SamplingParams
from tests.bus_helpers import scheduler_stats

pytestmark = pytest.mark.stack
LONG = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}  # runs until something ends it
GRACE_S = 3  # --worker-grace-s: a moved request waits this long for a worker


@pytest.fixture(scope="module")
def fault_stack(tmp_path_factory):
    from tests.conftest import _start_stack

    s = _start_stack(tmp_path_factory, "faults", num_workers=1, extra_args=["--worker-grace-s", str(GRACE_S)])
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


async def test_a_worker_whose_step_fails_on_the_bus_strands_no_request(fault_stack, model_name):
    """A peer that says hello as a worker of the model and answers each Step with micro's error
    headers (as a handler that raised does): the scheduler's loop for it must not die with the
    request on it (before: the request waited forever). Its requests move to the real worker and
    end with their lone run's tokens; the failed pool is dropped."""
    from shared.bus.endpoints import ERROR_CODE_HEADER, ERROR_HEADER
    from shared.wire import subjects
    from shared.wire.messages import WORKER_ANNOUNCE_DECODER, Discover, WorkerHeartbeat, WorkerHello, encode

    nc = await nats.connect(fault_stack.admin_url)
    hellos = await nc.subscribe(subjects.WORKERS_HELLO)
    await nc.publish(subjects.WORKERS_DISCOVER, encode(Discover(model=model_name)))
    real = next(h for h in [WORKER_ANNOUNCE_DECODER.decode((await hellos.next_msg(10)).data)]
                if isinstance(h, WorkerHello))
    await hellos.unsubscribe()
    steps = []

    async def fail(msg):
        steps.append(msg)
        await nc.publish(msg.reply, b"", headers={ERROR_HEADER: "KeyError: 'x'", ERROR_CODE_HEADER: "500"})

    await nc.subscribe(subjects.worker_step("rogue"), cb=fail)
    rogue = msgspec.structs.replace(real, worker_id="rogue")
    await nc.publish(subjects.WORKERS_HELLO, encode(rogue))

    async def beat():
        while True:
            await nc.publish(subjects.WORKERS_HEARTBEAT, encode(WorkerHeartbeat(worker_id="rogue", model=model_name)))
            await asyncio.sleep(1)

    beating = asyncio.create_task(beat())
    deadline = time.monotonic() + 30
    while (await scheduler_stats(nc, model_name)).num_workers < 2:
        assert time.monotonic() < deadline, "the rogue worker was never taken"
        await asyncio.sleep(0.1)
    bus = BusClient(nc)
    await bus.start()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[1000 + i for i in range(20)], [2000 + i for i in range(20)]]
    try:
        streams = [await bus.submit(model_name, p, params) for p in prompts]
        got = [[t for e in [x async for x in s.entries(timeout=60)] for t in e.token_ids] for s in streams]
        alone = []
        for p in prompts:
            again = await bus.submit(model_name, p, params)
            alone.append([t for e in [x async for x in again.entries(timeout=60)] for t in e.token_ids])
    finally:
        beating.cancel()
        await bus.stop()
    assert steps, "no Step reached the rogue worker"
    assert got == alone and all(len(g) == 24 for g in got)
    assert '"event": "pool_loop_failed"' in (fault_stack.log_dir / "scheduler.log").read_text()
    await nc.close()


async def test_a_request_whose_only_worker_stays_gone_ends_with_a_retryable_error(fault_stack, client, model_name):
    """The model's only worker paused past the 5 s silence: its request is held for --worker-grace-s
    (3 s here), then ends with a 503 the client may retry; the worker, running again, serves anew."""
    import signal

    openai = pytest.importorskip("openai")
    stream = await client.completions.create(model=model_name, prompt="Tell me a long story.", stream=True, **LONG)
    await stream.__anext__()
    worker = fault_stack.service("worker-0").proc
    worker.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        with pytest.raises(openai.APIError, match="could take the request for 3s"):
            async for _ in stream:
                pass
        assert GRACE_S <= time.monotonic() - stopped_at < 30  # held for the grace at least, then ended
    finally:
        worker.send_signal(signal.SIGCONT)
    await asyncio.to_thread(fault_stack.wait_ready, 120)
    done = await client.completions.create(model=model_name, prompt="Hello", max_tokens=4)
    assert done.usage.completion_tokens == 4
