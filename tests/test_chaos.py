"""The stack as a platform runs it (bench/chaos: a NATS cluster of three, a scheduler and its standby,
two workers, two gateways, LoRA adapters, `make run`'s defaults), under the launcher's supervision:
first the restart path alone at c=16, then 2.4 minutes of mixed load with every fault kind once
(CI's fixed schedule). Every exact request must end with its lone run's tokens, none may hang, and
nothing may be left held or leaked."""

from __future__ import annotations

import asyncio
import io
import random
import signal

import nats
import pytest

from bench.chaos.faults import FAULTS, FIXED, FIXED_MINUTES
from bench.chaos.report import table, verdict
from bench.chaos.run import run_load, start_stack
from services.scheduler.lease import LEASES_BUCKET
from shared.bus import servers
from shared.bus.client import BusClient
from shared.control.registry import AGENTS_BUCKET, ARTIFACTS_BUCKET, REGISTRY_BUCKET
from shared.wire import subjects
from shared.wire.messages import STEP_RESULT_DECODER, SamplingParams, Step, encode
from tests.streaming import stream_completion

pytestmark = pytest.mark.stack
openai = pytest.importorskip("openai")
CONCURRENCY = 16
MAX_TOKENS = 288  # long enough that the restarted worker rejoins while they stream


@pytest.fixture(scope="module")
def chaos_stack(tmp_path_factory, hf_model):
    stack = start_stack(tmp_path_factory.mktemp("chaos"), base=hf_model)  # the session's transformers model
    yield stack
    stack.stop()
    assert stack.leftovers() == [], "processes outlived the stack"
    assert stack.lost_tasks() == [], "a task failed and nobody saw it"


async def _admin(chaos_stack) -> nats.aio.client.Client:
    return await nats.connect(servers(chaos_stack.stack.admin_url), max_reconnect_attempts=-1, reconnect_time_wait=0.1)


async def test_every_store_is_kept_on_three_nodes(chaos_stack, model_name):
    """The launcher's --nats-cluster 3: every JetStream store at replication 3 (a leader and two
    followers). The file uploaded here must outlive the chaos run's node kills (read at its end)."""
    client = openai.OpenAI(base_url=chaos_stack.stack.base_url + "/v1", api_key="-", max_retries=0, timeout=60)
    chaos_stack.kept_file = client.files.create(file=("kept.jsonl", io.BytesIO(b'{"kept": true}\n')),
                                                purpose="batch").id
    client.responses.create(model=model_name, input="Hi", max_output_tokens=4)  # stored: the Responses store
    nc = await _admin(chaos_stack)
    try:
        js = nc.jetstream()
        for stream in (f"KV_{REGISTRY_BUCKET}", f"KV_{AGENTS_BUCKET}", f"OBJ_{ARTIFACTS_BUCKET}", "OBJ_SY_FILES",
                       "SY_RESPONSES", f"KV_{LEASES_BUCKET}"):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, stream
            assert len(info.cluster.replicas or []) == 2, stream
    finally:
        await nc.close()


async def test_a_worker_refuses_a_step_from_a_deposed_leader(chaos_stack, model_name):
    """The workers have seen the leader's lease token (1 or more): a Step with a lower one (0) is
    refused as fenced, as a deposed leader's would be, and the worker goes on serving the leader."""
    nc = await _admin(chaos_stack)
    bus = BusClient(nc)
    await bus.start()
    try:  # a worker the leader has stepped (it has seen its token)
        stream = await bus.submit(model_name, [1000 + i for i in range(20)], SamplingParams(max_tokens=4))
        [e async for e in stream.entries(timeout=60)]
        stale = Step(step_id=10**9, fence=0)
        result = STEP_RESULT_DECODER.decode((await nc.request(subjects.worker_step(stream.worker_id), encode(stale),
                                                                timeout=10)).data)
    finally:
        await bus.stop()
        await nc.close()
    assert result.fenced and "leads" in result.error
    client = openai.AsyncOpenAI(base_url=chaos_stack.stack.base_url + "/v1", api_key="-", max_retries=0, timeout=60)
    answer = await client.completions.create(model=model_name, prompt="Hi", max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop")


async def test_a_worker_that_saw_a_token_the_bucket_lost_does_not_depose_the_leader(chaos_stack, model_name):
    """A NATS node's loss can take the lease bucket's last writes with it, so a new leader's token (a
    revision) may be below one a worker saw from a leader before it. Here a worker is shown a token
    above any revision: the leader's next Step to it is refused, the leader's renewal says the key is
    still its own, its token rises past the worker's, and the same scheduler goes on answering."""
    nc = await _admin(chaos_stack)
    bus = BusClient(nc)
    await bus.start()
    prompt, ahead = [2000 + i for i in range(40)], 10**9
    try:
        first = await bus.submit(model_name, prompt, SamplingParams(max_tokens=4))
        [e async for e in first.entries(timeout=60)]
        step = subjects.worker_step(first.worker_id)
        seen = STEP_RESULT_DECODER.decode((await nc.request(step, encode(Step(step_id=10**9 + 1, fence=ahead)),
                                                            timeout=10)).data)
        assert not seen.fenced
        again = await bus.submit(model_name, prompt, SamplingParams(max_tokens=4))  # its prefix: the same worker
        entries = [e async for e in again.entries(timeout=60)]
        stale = STEP_RESULT_DECODER.decode((await nc.request(step, encode(Step(step_id=10**9 + 2, fence=ahead)),
                                                             timeout=10)).data)
    finally:
        await bus.stop()
        await nc.close()
    assert again.worker_id == first.worker_id and again.scheduler_id == first.scheduler_id
    assert entries and not any(e.error for e in entries)
    assert stale.fenced and stale.newest_fence == ahead + 1  # the leader's token, raised past the worker's


async def test_the_leaders_accepted_says_it_leads_by_a_lease(chaos_stack, model_name):
    """A client not yet subscribed to any heartbeat learns from the Accepted alone that the holder
    leads by a lease: had the leader died before its first heartbeat reached the client, the request
    would go to the standby rather than end with an error (CI once lost 26 requests so)."""
    nc = await _admin(chaos_stack)
    bus = BusClient(nc)  # not started: it hears no heartbeat
    try:
        stream = await bus.submit(model_name, [1000 + i for i in range(20)], SamplingParams(max_tokens=4))
        assert stream.scheduler_id and stream.scheduler_id in bus.leased
        await bus.abort(model_name, [stream.request_id])
    finally:
        await nc.close()


async def test_a_worker_killed_and_restarted_by_the_launcher_under_load_loses_no_token(chaos_stack, model_name):
    """The issue's path: 16 greedy streams, the busier worker SIGKILLed after their first tokens;
    its requests move to the other worker, the launcher restarts it, and it rejoins while they still
    stream. Every stream ends with a lone run's tokens."""
    distinct = [f"Write about the yard's track number {i}." for i in range(CONCURRENCY // 4)]
    prompts = distinct * 4  # each four times, through each gateway twice (their lone runs are most of the time)
    clients = [openai.AsyncOpenAI(base_url=chaos_stack.stack.gateway_url(i) + "/v1", api_key="-", max_retries=0,
                                  timeout=300) for i in range(2)]
    alone = [(await stream_completion(clients[0], model_name, p, MAX_TOKENS, asyncio.Event()))[0] for p in distinct] * 4
    started = [asyncio.Event() for _ in prompts]
    streams = [asyncio.create_task(stream_completion(clients[i // len(distinct) % 2], model_name, p, MAX_TOKENS, e))
               for i, (p, e) in enumerate(zip(prompts, started, strict=True))]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    victim = await chaos_stack.busiest_worker(random.Random(0))
    pid = chaos_stack.stack.service(victim).proc.pid
    chaos_stack.signal(victim, signal.SIGKILL)
    rejoined_while_streaming = False
    while not all(s.done() for s in streams):
        stats = await chaos_stack.stats()
        new_pid = chaos_stack.stack.service(victim).proc.pid
        if new_pid != pid and stats.num_workers == 2 and stats.num_running:
            rejoined_while_streaming = True
        await asyncio.sleep(0.5)
    done = [s.result() for s in streams]
    assert [finish for _, finish, _ in done] == ["length"] * CONCURRENCY
    assert [text for text, _, _ in done] == alone
    assert rejoined_while_streaming, "the restarted worker should rejoin while the moved requests stream"
    assert (await chaos_stack.stats()).num_migrations >= 1


def test_every_fault_once_under_a_mixed_load(chaos_stack):
    result = asyncio.run(run_load(chaos_stack, minutes=FIXED_MINUTES, fixed=True))
    v = verdict(result)
    print(table(result, v))
    assert {f.kind for f in result.faults} == set(FAULTS) == {kind for _, kind in FIXED}
    assert v.ok, table(result, v)
    assert v.by_status["whole"] >= 30  # the load ran through it all
    assert all(distinct == 1 for distinct, _ in result.squeeze_answers)  # preempted, recomputed alike
    patient = openai.OpenAI(base_url=chaos_stack.stack.base_url + "/v1", api_key="-", max_retries=8, timeout=60)
    assert patient.files.content(chaos_stack.kept_file).read() == b'{"kept": true}\n'  # outlived the node kills
