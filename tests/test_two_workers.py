"""Two workers: a request whose prefix is cached is routed to the worker that holds it; the
KV-cache service knows which pool holds what, and rebuilds that after its own restart; a request
on a LoRA adapter goes to the worker already running it."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest

from shared.bus.client import BusClient
from shared.wire import subjects
from shared.wire.kv_events import KV_STATS_REPLY_DECODER, KvStatsRequest
from shared.wire.lora import LORA_STATE_DECODER, LoadLora
from shared.wire.messages import (
    STEP_RESULT_DECODER,
    WORKER_ANNOUNCE_DECODER,
    Discover,
    FinishReason,
    SamplingParams,
    Step,
    StepResult,
    WorkerHello,
    encode,
)
from tests.bus_helpers import scheduler_stats

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def two_worker_stack(tmp_path_factory, model_name):
    from tests.conftest import _start_stack

    s = _start_stack(tmp_path_factory, "two-workers", num_workers=2, extra_args=["--enable-lora", "--max-migrations", "1"])
    asyncio.run(_wait_for_workers(s.admin_url, model_name, 2))  # /health is ready with one; routing needs both
    yield s
    s.stop()


async def _wait_for_workers(nats_url: str, model: str, num_workers: int, timeout_s: float = 240.0) -> None:
    nc = await nats.connect(nats_url)
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while True:
            if (await scheduler_stats(nc, model)).num_workers == num_workers:
                return
            assert asyncio.get_running_loop().time() < deadline, f"{num_workers} workers never joined"
            await asyncio.sleep(0.25)
    finally:
        await nc.close()


async def run(bus: BusClient, model: str, prompt_ids: list[int], max_tokens: int, lora: str | None = None):
    stream = await bus.submit(model, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                 ignore_eos=True), lora=lora)
    entries = [e async for e in stream.entries(timeout=120)]
    return stream.worker_id, entries[0].num_cached_tokens, [t for e in entries for t in e.token_ids]


async def kv_stats(nc) -> dict[str, int]:
    msg = await nc.request(subjects.KV_STATS, encode(KvStatsRequest()), timeout=2)
    return KV_STATS_REPLY_DECODER.decode(msg.data).num_blocks_by_pool


async def test_prefix_routing_and_kv_index(two_worker_stack, model_name):
    nc = await nats.connect(two_worker_stack.admin_url)
    bus = BusClient(nc)
    await bus.start()
    p1 = [1000 + i for i in range(80)]
    p2 = [5000 + i for i in range(80)]
    # p1 runs long on one worker (it has produced a token and has 119 to go), so least-load sends
    # p2 to the other
    long_stream = await bus.submit(model_name, p1 + [1], SamplingParams(max_tokens=120, temperature=0.0,
                                                                        ignore_eos=True))
    long_entries = long_stream.entries(timeout=120)
    cached1 = (await long_entries.__anext__()).num_cached_tokens
    w2, cached2, _ = await run(bus, model_name, p2 + [1], 4)
    assert not long_stream.is_finished
    assert [e async for e in long_entries][-1].finish_reason == FinishReason.LENGTH
    w1 = long_stream.worker_id
    assert {w1, w2} == {"worker-0", "worker-1"} and cached1 == cached2 == 0

    # both idle now: with plain least-load both repeats would go to the same worker
    for prefix, home in ((p1, w1), (p2, w2)):
        worker, cached, _ = await run(bus, model_name, prefix + [2], 4)
        assert worker == home
        assert cached == 80  # 5 full blocks of 16

    stats = await kv_stats(nc)
    assert stats["worker-0"] >= 5 and stats["worker-1"] >= 5

    # the index rebuilds itself from the schedulers after a restart
    kvcache = two_worker_stack.service("kvcache")
    kvcache.proc.kill()
    kvcache.proc.wait()
    kvcache.start(two_worker_stack._env("kvcache"))
    for _ in range(100):
        await asyncio.sleep(0.2)
        try:
            if await kv_stats(nc) == stats:
                break
        except Exception:
            continue
    assert await kv_stats(nc) == stats
    await bus.stop()
    await nc.close()


async def test_a_request_on_an_adapter_goes_to_the_worker_already_running_it(two_worker_stack, model_name,
                                                                           hf_model, tmp_path):
    """Loaded on both workers at run time (through the scheduler, as the API's route does); a second
    request on the adapter, with no prefix in common, joins the worker whose slots hold it, where
    least load alone would send it to the idle one; a base request still goes by load."""
    pytest.importorskip("peft")
    from tests.test_lora_stack import _save

    _save(hf_model, tmp_path / "adapter", 4, ["q_proj", "v_proj"], False, 5)
    nc = await nats.connect(two_worker_stack.admin_url)
    loaded = await nc.request(subjects.lora(model_name), encode(LoadLora("route-me", str(tmp_path / "adapter"))),
                              timeout=60)
    assert LORA_STATE_DECODER.decode(loaded.data).error is None
    bus = BusClient(nc)
    await bus.start()
    first = await bus.submit(model_name, [7000 + i for i in range(20)],
                             SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True), lora="route-me")
    entries = first.entries(timeout=120)
    await entries.__anext__()
    home = first.worker_id
    worker, _, _ = await run(bus, model_name, [9000 + i for i in range(20)], 4, lora="route-me")
    assert worker == home and not first.is_finished
    worker, _, _ = await run(bus, model_name, [11000 + i for i in range(20)], 4)
    assert worker != home and not first.is_finished
    assert [e async for e in entries][-1].finish_reason == FinishReason.LENGTH
    await bus.stop()
    await nc.close()


async def test_a_worker_back_after_it_was_declared_gone_drops_what_moved_away_and_drains_at_once(
        two_worker_stack, model_name):
    """Paused past its 5 s of silence, a worker's requests move to the other; when it runs again it
    rejoins as a new pool, whose first Step makes it forget them, so a SIGTERM then stops it at once
    (before, its drain waited the 30 s grace for sequences it no longer served)."""
    import signal
    import time

    nc = await nats.connect(two_worker_stack.admin_url)
    bus = BusClient(nc)
    await bus.start()
    try:
        stream = await bus.submit(model_name, [7000 + i for i in range(20)],
                                  SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        reader = stream.entries(timeout=120)
        await reader.__anext__()
        victim = two_worker_stack.service(stream.worker_id)
        victim.proc.send_signal(signal.SIGSTOP)
        await _wait_for_workers(two_worker_stack.admin_url, model_name, 1, timeout_s=60)  # declared gone
        victim.proc.send_signal(signal.SIGCONT)
        await _wait_for_workers(two_worker_stack.admin_url, model_name, 2, timeout_s=60)  # rejoined
        stopping = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)
        victim.proc.wait(timeout=25)
        assert time.monotonic() - stopping < 10
        assert [e async for e in reader][-1].finish_reason == FinishReason.LENGTH  # finished on the other
    finally:
        await bus.stop()
        if victim.proc.poll() is not None:  # the next test finds the new process joined, not the old one listed
            await _wait_for_workers(two_worker_stack.admin_url, model_name, 1, timeout_s=60)  # its silence noticed
            victim.start(two_worker_stack._env(victim.name))
        await _wait_for_workers(two_worker_stack.admin_url, model_name, 2)
        await nc.close()



async def test_a_worker_paused_and_back_as_the_same_process_costs_its_requests_no_move(two_worker_stack, model_name):
    """--max-migrations 1 (this stack's): a request moved off a worker paused past its silence, and
    off the other one once the first was back, goes on both times. A worker back as the same process
    was paused or cut off, not brought down by the request, so that move is given back (before, the
    second move failed the request with a 503)."""
    import signal

    nc = await nats.connect(two_worker_stack.admin_url)
    bus = BusClient(nc)
    await bus.start()
    stream = await bus.submit(model_name, [7100 + i for i in range(20)],
                              SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))
    reader = stream.entries(timeout=120)

    async def read_until(worker_id: str, in_a_row: int = 1) -> None:
        """Tokens until `in_a_row` entries in a row come from worker_id; none may be an error. (A worker
        back from a pause publishes the rest of the Step it was running: past the other worker's tokens
        early on, they are read as its own for a moment.)"""
        count = 0
        while count < in_a_row:
            entry = await reader.__anext__()
            assert entry.error is None and entry.finish_reason is None, entry.error
            count = count + 1 if stream.worker_id == worker_id else 0

    await reader.__anext__()
    first = stream.worker_id
    second = next(s.name for s in two_worker_stack.services if s.name.startswith("worker") and s.name != first)
    try:
        for victim, taker in ((first, second), (second, first)):
            await read_until(victim, in_a_row=8)  # more than a multi-step Step's tokens: on the victim alone
            two_worker_stack.service(victim).proc.send_signal(signal.SIGSTOP)
            await read_until(taker)  # moved: the victim was declared gone (not another worker's departure)
            two_worker_stack.service(victim).proc.send_signal(signal.SIGCONT)
            await _wait_for_workers(two_worker_stack.admin_url, model_name, 2, timeout_s=60)  # back: forgiven
        await read_until(first)  # ... and went on after the second move
        await stream.abort()
    finally:
        for name in (first, second):
            two_worker_stack.service(name).proc.send_signal(signal.SIGCONT)
        await bus.stop()
        await nc.close()


async def test_a_hello_from_a_new_process_under_a_live_workers_id_moves_what_it_held(two_worker_stack, model_name):
    """A worker killed and started again within its 5 s of silence says hello with a new `instance`:
    the scheduler takes that as the restart it is (before, it stepped the new process for sequences
    it never had: a KeyError for each, and prefix hits on blocks it never computed). Here the hello is
    one under the running worker's id with another instance; the request it held moves and gives a
    lone run's tokens, and a hello of the real process afterwards is taken back the same way."""
    nc = await nats.connect(two_worker_stack.admin_url)
    hellos = await _hellos(nc)
    bus = BusClient(nc)
    await bus.start()
    prompt, sampling = [7300 + i for i in range(20)], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    try:
        stream = await bus.submit(model_name, prompt, sampling)
        reader = stream.entries(timeout=120)
        tokens = list((await reader.__anext__()).token_ids)
        held_by = stream.worker_id
        await nc.publish(subjects.WORKERS_DISCOVER, encode(Discover(model=model_name)))
        hello = await _hello_of(hellos, held_by)
        await nc.publish(subjects.WORKERS_HELLO, encode(msgspec.structs.replace(hello, instance="another process")))
        async for entry in reader:
            assert entry.error is None, entry.error
            tokens += entry.token_ids
        assert stream.worker_id != held_by  # it moved
        await nc.publish(subjects.WORKERS_DISCOVER, encode(Discover(model=model_name)))  # the real one's hello
        await _wait_for_workers(two_worker_stack.admin_url, model_name, 2, timeout_s=60)
        lone = await bus.submit(model_name, prompt, sampling)
        assert [t async for e in lone.entries(timeout=120) for t in e.token_ids] == tokens
    finally:
        await bus.stop()
        await nc.close()


async def _hellos(nc) -> asyncio.Queue:
    """Every worker's hello from now on."""
    hellos: asyncio.Queue = asyncio.Queue()

    async def heard(msg) -> None:
        hellos.put_nowait(WORKER_ANNOUNCE_DECODER.decode(msg.data))

    await nc.subscribe(subjects.WORKERS_HELLO, cb=heard)
    return hellos


async def _hello_of(hellos: asyncio.Queue, worker_id: str) -> WorkerHello:
    while True:
        announce = await asyncio.wait_for(hellos.get(), 30)
        if isinstance(announce, WorkerHello) and announce.worker_id == worker_id:
            return announce


async def test_a_fresh_worker_refuses_a_step_meant_for_its_process_before(two_worker_stack):
    """A new process's first Step must be a new pool's (reset): one that is not was meant for the
    process before it under the same id, and is refused as `restarted` (the scheduler then moves what
    it held) rather than run against sequences the new process never had."""
    nc = await nats.connect(two_worker_stack.admin_url)
    hellos = await _hellos(nc)
    worker = two_worker_stack.add_worker("worker-unheard", "--model", "unheard")  # no scheduler steps it
    try:
        await _hello_of(hellos, "worker-unheard")
        subject = subjects.worker_step("worker-unheard")

        async def step(step_id: int, reset: bool) -> StepResult:
            reply = await nc.request(subject, encode(Step(step_id=step_id, reset=reset)), timeout=30)
            return STEP_RESULT_DECODER.decode(reply.data)

        refused = await step(1, reset=False)
        assert refused.restarted and "restarted" in refused.error
        assert not (await step(2, reset=True)).restarted
        assert (await step(3, reset=False)).error is None
    finally:
        worker.proc.terminate()
        worker.proc.wait(timeout=60)
        two_worker_stack.services.remove(worker)
        await nc.close()
