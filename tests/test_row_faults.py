"""One bad request never fails the requests batched with it: the scheduler refuses a Submit the
worker could not run, and a row that still fails on the worker fails alone."""

from __future__ import annotations

import asyncio

import nats
import pytest

from services.scheduler.validate import submit_error
from shared.bus.client import BusClient, SubmitRejected
from shared.wire.messages import Guided, GuidedKind, RejectCode, SamplingParams, Submit
from tests.inproc_engine import InProcessEngine

VOCAB = 49152


def _submit(**fields) -> Submit:
    sampling = SamplingParams(**fields.pop("sampling", {}))
    base = dict(request_id="r", model="m", prompt_token_ids=[1, 2, 3], sampling=sampling, reply_to="sy.v1.out.x",
                arrival_time=0.0)
    return Submit(**(base | fields))


@pytest.mark.parametrize(("fields", "why"), [
    (dict(sampling=dict(logit_bias={VOCAB: 1.0})), "logit_bias: token id 49152 is outside the vocabulary"),
    (dict(sampling=dict(logit_bias={-1: 1.0})), "logit_bias: token id -1"),
    (dict(sampling=dict(logit_bias={5: float("nan")})), "logit_bias values must be in [-100, 100]"),
    (dict(prompt_token_ids=[1, VOCAB + 7]), "prompt_token_ids: token id 49159"),
    (dict(prompt_token_ids=[]), "the prompt is empty"),
    (dict(sampling=dict(allowed_token_ids=[2**40])), "allowed_token_ids: token id 1099511627776"),
    (dict(sampling=dict(stop_token_ids=[-3])), "stop_token_ids: token id -3"),
    (dict(sampling=dict(max_tokens=0)), "max_tokens must be at least 1"),
    (dict(resume_token_ids=[5, 2**40]), "resume_token_ids: token id 1099511627776"),
    (dict(resume_token_ids=[5] * 16, sampling=dict(max_tokens=16)), "16 tokens leave none of max_tokens"),
    (dict(sampling=dict(max_tokens=4, min_tokens=5)), "min_tokens must be in [0, max_tokens]"),
    (dict(sampling=dict(temperature=float("inf"))), "temperature must be >= 0"),
    (dict(sampling=dict(top_p=0.0)), "top_p must be in (0, 1]"),
    (dict(sampling=dict(top_k=-5)), "top_k must be >= 0"),
    (dict(sampling=dict(repetition_penalty=0.0)), "repetition_penalty must be > 0"),
    (dict(sampling=dict(logprobs=VOCAB + 1)), "logprobs must be in [0, 49152]"),
    (dict(reply_to="sy.v1.out.>"), "reply_to must be one concrete NATS subject"),
    (dict(request_id=""), "request_id must be 1 to 256 characters"),
    (dict(deadline=float("nan")), "deadline must be a finite number"),
])
def test_the_scheduler_refuses_a_submit_the_worker_could_not_run(fields, why):
    assert why in submit_error(_submit(**fields), VOCAB)


def test_a_well_formed_submit_passes():
    assert submit_error(_submit(sampling=dict(logit_bias={VOCAB - 1: -100.0}, logprobs=20, seed=-1)), VOCAB) is None


def test_a_row_that_raises_on_the_worker_fails_alone(loaded_model):
    """Requests that bypass the scheduler's checks (an out-of-range logit_bias, a grammar the
    worker cannot compile) end with an error; the rows batched with them get the tokens they get alone."""
    prompts = {f"ok{i}": [100 + i * 7 + j for j in range(12 + i)] for i in range(3)}
    alone = {}
    for request_id, ids in prompts.items():
        engine = InProcessEngine(loaded_model, num_blocks=64)
        engine.add(request_id, ids, 6)
        alone |= engine.run()
    engine = InProcessEngine(loaded_model, num_blocks=128)
    engine.add("bias", [5, 6, 7], 6, logit_bias={10**9: 1.0})
    for request_id, ids in prompts.items():
        engine.add(request_id, ids, 6)
    engine.add("grammar", [8, 9], 6, guided=Guided(kind=GuidedKind.REGEX, schema="a+"))
    out = engine.run()
    assert {k: out[k] for k in prompts} == alone
    assert out["bias"] == [] and "IndexError" in engine.errors["bias"]
    assert out["grammar"] == [] and "without a tokenizer" in engine.errors["grammar"]
    assert engine.runner.seqs == {} and set(engine.errors) == {"bias", "grammar"}


@pytest.mark.stack
async def test_a_bad_bus_submit_is_refused_and_the_streams_beside_it_finish(stack, async_openai_client, model_name):
    nc = await nats.connect(stack.admin_url)
    bus = BusClient(nc)
    await bus.start()

    async def stream(i: int) -> str:
        chunks = await async_openai_client.completions.create(
            model=model_name, prompt=f"Count to ten, take {i}:", max_tokens=12, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in chunks])

    streams = [asyncio.create_task(stream(i)) for i in range(4)]
    with pytest.raises(SubmitRejected) as refused:
        await bus.submit(model_name, [1, 2, 3], SamplingParams(max_tokens=8, logit_bias={10**6: 5.0}))
    assert refused.value.code == RejectCode.INVALID and "outside the vocabulary" in refused.value.reason
    assert all(await asyncio.gather(*streams))
    await bus.stop()
    await nc.close()


@pytest.mark.stack
async def test_a_request_moves_off_a_dead_worker_at_most_max_migrations_times():
    """_fail_over hands back what the dead worker held, with its progress, unless the request has
    moved max_migrations times already: then its client gets the error (on a real bus)."""
    from services.scheduler.pool import PoolLoop
    from services.scheduler.request import Request
    from shared.bus.liveness import Heartbeats
    from shared.config import EngineConfig
    from shared.wire.messages import TOKEN_BATCH_DECODER, BackendName, FinishReason, WorkerHello, WorkerKind
    from switchyard.nats_server import NatsServer

    server = NatsServer().start()
    nc = await nats.connect(server.url)
    errors = asyncio.Queue()

    async def on_reply(msg):
        for entry in TOKEN_BATCH_DECODER.decode(msg.data).entries:
            errors.put_nowait(entry)

    await nc.subscribe("sy.v1.out.test", cb=on_reply)
    handed_back = []

    async def on_gone(_pool, requeue):
        handed_back.extend(requeue)

    hello = WorkerHello(worker_id="w", model="m", backend=BackendName.TORCH_CPU, kind=WorkerKind.PAGED,
                        num_blocks=16, block_size=16, max_batch=4, dtype="float32", max_model_len=256)
    pool = PoolLoop(nc, hello, EngineConfig(max_migrations=1), on_gone=on_gone, can_run_more=lambda: True,
                    workers=Heartbeats(nc, 5.0))
    fresh, worn = (Request(rid, [1, 2, 3], SamplingParams(max_tokens=8), reply_to="sy.v1.out.test")
                   for rid in ("fresh", "worn"))
    for request in (fresh, worn):
        request.output_token_ids, request.is_on_worker, request.num_computed_tokens = [7, 8], True, 4
        pool.scheduler.requests[request.request_id] = request
    worn.num_migrations = 1
    assert await pool._fail_over("worker w is gone") == ["fresh"]  # the moves it counted (worn's was refused)
    assert [r.request_id for r in handed_back] == ["fresh"]
    assert (fresh.num_migrations, fresh.num_computed_tokens, fresh.is_on_worker, fresh.output_token_ids) == \
        (1, 0, False, [7, 8])  # recomputed elsewhere from prompt + outputs so far
    error = await asyncio.wait_for(errors.get(), 5)
    assert error.request_id == "worn" and error.finish_reason == FinishReason.ERROR and error.offset == 2
    assert "as often as --max-migrations (1) allows" in error.error
    await nc.close()
    server.stop()
