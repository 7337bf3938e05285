"""The stack as a platform runs it (bench/chaos: a NATS cluster of three, a scheduler and its standby,
two workers, two gateways, LoRA adapters, `make run`'s defaults), under the launcher's supervision:
first the restart path alone at c=16, then three minutes of mixed load with every fault kind once
(CI's fixed schedule). Every exact request must end with its lone run's tokens, none may hang, and
nothing may be left held or leaked."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from bench.chaos.faults import FAULTS, FIXED
from bench.chaos.report import table, verdict
from bench.chaos.run import run_load, start_stack
from tests.streaming import stream_completion

pytestmark = pytest.mark.stack
openai = pytest.importorskip("openai")
CONCURRENCY = 16
MAX_TOKENS = 288  # long enough that the restarted worker rejoins while they stream


@pytest.fixture(scope="module")
def chaos_stack(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("chaos"))
    yield stack
    stack.stop()
    assert not [pid for pid in stack.descendants() if _running(pid)], "processes outlived the stack"


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_a_worker_killed_and_restarted_by_the_launcher_under_load_loses_no_token(chaos_stack, model_name):
    """The issue's path: 16 greedy streams, the busier worker SIGKILLed after their first tokens;
    its requests move to the other worker, the launcher restarts it, and it rejoins while they still
    stream. Every stream ends with a lone run's tokens."""
    prompts = [f"Write about the yard's track number {i}." for i in range(CONCURRENCY)]
    clients = [openai.AsyncOpenAI(base_url=chaos_stack.stack.gateway_url(i) + "/v1", api_key="-", max_retries=0,
                                  timeout=300) for i in range(2)]
    alone = [(await stream_completion(clients[0], model_name, p, MAX_TOKENS, asyncio.Event()))[0] for p in prompts]
    started = [asyncio.Event() for _ in prompts]
    streams = [asyncio.create_task(stream_completion(clients[i % 2], model_name, p, MAX_TOKENS, e))
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


def test_three_minutes_of_faults_under_a_mixed_load(chaos_stack):
    result = asyncio.run(run_load(chaos_stack, minutes=3, fixed=True))
    v = verdict(result)
    print(table(result, v))
    assert {f.kind for f in result.faults} == set(FAULTS) == {kind for _, kind in FIXED}
    assert v.ok, table(result, v)
    assert v.by_status["whole"] >= 50  # the load ran through it all
    assert all(distinct == 1 for distinct, _ in result.squeeze_answers)  # preempted, recomputed alike
