"""The bus client's request streams, on a real nats-server: order, the idle timeout, cleanup."""

from __future__ import annotations

import asyncio

import nats
import pytest

from shared.client import BusClient, RequestStream
from shared.messages import FinishReason, TokenBatch, TokenEntry, encode

pytestmark = pytest.mark.stack


async def _client(stack) -> BusClient:
    bus = BusClient(await nats.connect(stack.nats_url))
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
    await asyncio.sleep(0.1)  # both queued before anyone reads
    reader = stream.entries(timeout=5)
    assert [e.token_ids for e in [await reader.__anext__(), await reader.__anext__()]] == [[5, 6], [7]]
    await bus.nc.publish(bus.reply_subject, encode(TokenBatch(entries=[
        TokenEntry("r1", 3, [8], finish_reason=FinishReason.LENGTH)])))
    assert [e.token_ids async for e in reader] == [[8]]  # waited for, then the stream ends
    assert stream.num_tokens == 4 and "r1" not in bus.streams
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
    gap = _stream(bus, "gap")
    await bus.nc.publish(bus.reply_subject, encode(TokenBatch(entries=[
        TokenEntry("gap", 0, [5]), TokenEntry("gap", 2, [7], finish_reason=FinishReason.LENGTH)])))
    with pytest.raises(RuntimeError, match="gap in token stream"):
        async for _ in gap.entries(timeout=5):
            pass
    await bus.stop()
    await bus.nc.close()


def test_a_mid_stream_token_entry_is_small_on_the_wire():
    """Per-request constants ride only in a stream's first entry, and the hot-path structs are
    arrays whose trailing defaults cost a byte each: one token of a 32-hex request id, 56 bytes."""
    from shared.messages import TOKEN_BATCH_DECODER, Logprobs

    request_id = "0123456789abcdef0123456789abcdef"
    mid = TokenEntry(request_id, 17, [4093], produced_at=1763900000.123)
    assert len(encode(mid)) == 56
    assert len(encode(TokenBatch(entries=[mid], worker_id="host-1a2b3c4d"))) == 79
    first = TokenEntry(request_id, 0, [4093], produced_at=1763900000.123, num_prompt_tokens=12,
                       num_cached_tokens=0, first_scheduled_at=1763899999.9, prompt_logprobs=[None, Logprobs(-1.5)])
    decoded = TOKEN_BATCH_DECODER.decode(encode(TokenBatch(entries=[first, mid])))
    assert decoded.entries == [first, mid]
