"""The bus client's request streams, on a real nats-server: order, the idle timeout, cleanup."""

from __future__ import annotations

import asyncio
import signal

import nats
import pytest

from shared.bus.client import BusClient, RequestStream
from shared.wire.messages import FinishReason, TokenBatch, TokenEntry, encode
from tests.bus_helpers import until

pytestmark = pytest.mark.stack


async def _client(stack) -> BusClient:
    bus = BusClient(await nats.connect(stack.admin_url))
    await bus.start()
    return bus


def _stream(bus: BusClient, request_id: str) -> RequestStream:
    stream = RequestStream(bus, "m", request_id)
    bus.streams[request_id] = stream
    return stream


async def test_entries_already_queued_and_later_ones_come_in_order(stack):
    bus = await _client(stack)
    stream = _stream(bus, "r1")
    entries = [TokenEntry("r1", 0, [5, 6]), TokenEntry("r1", 2, [7])]
    await bus.nc.publish(bus.reply_subject, encode(TokenBatch(entries=entries)))
    await bus.nc.flush()
    await until(lambda: stream.queue.qsize() == 2)  # both queued before anyone reads
    reader = stream.entries(timeout=5)
    assert [e.token_ids for e in [await reader.__anext__(), await reader.__anext__()]] == [[5, 6], [7]]
    await bus.nc.publish(bus.reply_subject, encode(TokenBatch(entries=[
        TokenEntry("r1", 3, [8], finish_reason=FinishReason.LENGTH)])))
    assert [e.token_ids async for e in reader] == [[8]]  # waited for, then the stream ends
    assert stream.num_tokens == 4 and "r1" not in bus.streams
    await bus.stop()
    await bus.nc.close()


async def test_the_streams_worker_is_the_one_whose_tokens_were_read_last(stack):
    """A worker paused and back sends tokens the request's new worker already sent: dropped, they do
    not make it the stream's worker, nor does a batch queued and not yet read."""
    bus = await _client(stack)
    stream = _stream(bus, "r5")
    for worker_id in ("worker-a", "worker-b"):  # worker-b's is the same tokens again
        await bus.nc.publish(bus.reply_subject, encode(TokenBatch([TokenEntry("r5", 0, [5, 6])], worker_id)))
    await bus.nc.flush()
    await until(lambda: stream.queue.qsize() == 2)
    reader = stream.entries(timeout=5)
    assert (await reader.__anext__()).token_ids == [5, 6] and stream.worker_id == "worker-a"
    await bus.nc.publish(bus.reply_subject, encode(TokenBatch(
        [TokenEntry("r5", 2, [7], finish_reason=FinishReason.LENGTH)], "worker-c")))
    assert [e.token_ids async for e in reader] == [[7]] and stream.worker_id == "worker-c"
    await bus.stop()
    await bus.nc.close()


async def test_no_token_within_the_idle_timeout_raises_and_forgets_the_stream(stack):
    bus = await _client(stack)
    stream = _stream(bus, "r2")
    with pytest.raises(TimeoutError):
        async for _ in stream.entries(timeout=0.05):
            pass
    assert "r2" not in bus.streams
    await bus.stop()
    await bus.nc.close()


async def test_the_schedulers_verdict_ends_the_stream_whatever_its_offset(stack):
    """A deadline's error entry counts the tokens the scheduler has seen, which may lag (or lead)
    what the worker streamed: it ends the stream; a token entry out of place is still a gap."""
    bus = await _client(stack)
    for request_id, verdict_offset in (("late", 1), ("early", 5)):
        stream = _stream(bus, request_id)
        await bus.nc.publish(bus.reply_subject, encode(TokenBatch(entries=[
            TokenEntry(request_id, 0, [5, 6]),
            TokenEntry(request_id, verdict_offset, [], finish_reason=FinishReason.TIMEOUT, error="deadline")])))
        got = [e async for e in stream.entries(timeout=5)]
        assert [e.error for e in got] == [None, "deadline"] and stream.num_tokens == 2
    await bus.stop()
    await bus.nc.close()


async def test_after_an_outage_duplicates_are_dropped_overlaps_trimmed_and_a_gap_is_asked_for(stack):
    """Entries sent again by a worker (Resend) can repeat, overlap or fill a gap: the reader sees
    each token once, in order, and asks for a gap's tokens itself."""
    from shared.wire import subjects
    from shared.wire.messages import RESEND_DECODER

    bus = await _client(stack)
    asked = asyncio.Queue()

    async def on_resend(msg):
        asked.put_nowait(RESEND_DECODER.decode(msg.data))

    sub = await bus.nc.subscribe(subjects.WORKERS_RESEND, cb=on_resend)
    stream = _stream(bus, "gap")
    await bus.nc.publish(bus.reply_subject, encode(TokenBatch(entries=[
        TokenEntry("gap", 0, [5]), TokenEntry("gap", 0, [5]), TokenEntry("gap", 3, [8])])))
    reader = stream.entries(timeout=5)
    assert (await reader.__anext__()).token_ids == [5]
    read_on = asyncio.ensure_future(reader.__anext__())  # offset 3 is past a gap: it waits
    resend = await asyncio.wait_for(asked.get(), 5)
    assert resend.reply_to == bus.reply_subject and resend.offsets == {"gap": 1}
    assert not read_on.done()
    await bus.nc.publish(bus.reply_subject, encode(TokenBatch(entries=[  # the worker's answer, overlapping
        TokenEntry("gap", 0, [5, 6, 7])])))
    assert (await read_on).token_ids == [6, 7]
    await bus.nc.publish(bus.reply_subject, encode(TokenBatch(entries=[
        TokenEntry("gap", 4, [9], finish_reason=FinishReason.LENGTH)])))
    assert [e.token_ids async for e in reader] == [[8], [9]]
    assert stream.num_tokens == 5
    await sub.unsubscribe()
    await bus.stop()
    await bus.nc.close()


def test_a_mid_stream_token_entry_is_small_on_the_wire():
    """Per-request constants ride only in a stream's first entry, and the hot-path structs are
    arrays whose trailing defaults cost a byte each: one token of a 32-hex request id, 57 bytes (the
    pooling requests' embedding added the last)."""
    from shared.wire.messages import TOKEN_BATCH_DECODER, Logprobs

    request_id = "0123456789abcdef0123456789abcdef"
    mid = TokenEntry(request_id, 17, [4093], produced_at=1763900000.123)
    assert len(encode(mid)) == 57
    assert len(encode(TokenBatch(entries=[mid], worker_id="host-1a2b3c4d"))) == 80
    first = TokenEntry(request_id, 0, [4093], produced_at=1763900000.123, num_prompt_tokens=12,
                       num_cached_tokens=0, first_scheduled_at=1763899999.9, prompt_logprobs=[None, Logprobs(-1.5)])
    decoded = TOKEN_BATCH_DECODER.decode(encode(TokenBatch(entries=[first, mid])))
    assert decoded.entries == [first, mid]


async def test_a_caller_cancelled_while_its_submit_is_answered_leaves_nothing_running(stack, model_name, hf_tokenizer):
    """The Submit is accepted after its caller gave up (a client gone, a cancelled background
    response): the client aborts it then, so the engine does not generate for no one."""
    from shared.wire import subjects
    from shared.wire.messages import TOKEN_BATCH_DECODER, SamplingParams

    bus = await _client(stack)
    spy = await nats.connect(stack.admin_url)
    seen, aborted = asyncio.Event(), asyncio.Event()
    submitting: asyncio.Task | None = None

    async def on_submit(msg) -> None:
        seen.set()
        submitting.cancel()  # the Submit is on its way to the scheduler; its caller gives up now

    async def on_reply(msg) -> None:
        if any(e.finish_reason == FinishReason.ABORT for e in TOKEN_BATCH_DECODER.decode(msg.data).entries):
            aborted.set()

    await spy.subscribe(subjects.submit(model_name), cb=on_submit)
    await spy.subscribe(bus.reply_subject, cb=on_reply)
    await spy.flush()
    sampling = SamplingParams(max_tokens=4000, ignore_eos=True)
    # the scheduler is held while the Submit is in flight, so the caller gives up before any answer
    # (unheld, a fast scheduler's answer could reach the client before the spy saw the Submit)
    scheduler = stack.service("scheduler").proc
    scheduler.send_signal(signal.SIGSTOP)
    try:
        submitting = asyncio.create_task(bus.submit(model_name, hf_tokenizer.encode("Tell a long story"), sampling,
                                                    request_id="given-up"))
        with pytest.raises(asyncio.CancelledError):
            await submitting
    finally:
        scheduler.send_signal(signal.SIGCONT)
    assert seen.is_set() and "given-up" not in bus.streams
    await asyncio.wait_for(aborted.wait(), 30)  # the scheduler ended it: its final entry says abort
    await spy.close()
    await bus.stop()
    await bus.nc.close()
