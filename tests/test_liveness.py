"""Heartbeats over a real nats-server that goes away: our own outage, or our own stall, is nobody's silence."""

from __future__ import annotations

import asyncio
import os
import signal

import nats
import pytest

from shared.bus.liveness import BusProbe, Heartbeats
from switchyard.nats_server import NatsServer
from tests.clock import ManualClock

pytestmark = pytest.mark.stack


@pytest.fixture
def server():
    """A nats-server of the test's own, stopped even when the test fails (a paused one included)."""
    started = NatsServer().start()
    yield started
    if started.proc.poll() is None:
        os.kill(started.proc.pid, signal.SIGCONT)
    started.stop()
WINDOW_S = 10.0
LOOK_S = 1.0  # a watch loop looks every fraction of the window


def _watch(beats: Heartbeats, clock: ManualClock, seconds: float) -> list[str]:
    """Look as a watch loop does, every LOOK_S of the clock, for `seconds`; the last answer."""
    silent = beats.silent()
    for _ in range(round(seconds / LOOK_S)):
        clock.advance(LOOK_S)
        silent = beats.silent()
    return silent


async def _connect(url: str) -> tuple[nats.aio.client.Client, asyncio.Event, asyncio.Event]:
    """A client that reconnects by itself, and the events of its connection going and coming back."""
    down, up = asyncio.Event(), asyncio.Event()

    async def on_down():
        down.set()

    async def on_up():
        up.set()

    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, disconnected_cb=on_down,
                            reconnected_cb=on_up)
    return nc, down, up


async def test_a_peer_falls_silent_after_the_window_and_an_outage_does_not_count(server):
    nc, down, up = await _connect(server.url)
    clock = ManualClock()
    beats = Heartbeats(nc, WINDOW_S, clock)
    beats.heard("worker")
    assert beats.silent() == []
    assert _watch(beats, clock, WINDOW_S) == []  # the window itself: not yet
    assert _watch(beats, clock, LOOK_S) == ["worker"]  # connected and nothing heard past it: silent

    beats.heard("worker")
    server.proc.kill()
    server.proc.wait()
    await asyncio.wait_for(down.wait(), 10)
    assert not nc.is_connected
    assert _watch(beats, clock, WINDOW_S * 3) == []  # far past the window, but we are the ones cut off
    server.start()  # same port: the client comes back by itself
    await asyncio.wait_for(up.wait(), 10)
    assert _watch(beats, clock, WINDOW_S * 2) == []  # after the outage: twice the window to be heard again
    assert beats.in_grace("worker") is False and _watch(beats, clock, LOOK_S) == ["worker"]
    await nc.close()


async def test_a_stall_of_our_own_loop_is_not_the_peers_silence(server):
    nc = await nats.connect(server.url)
    clock = ManualClock()
    beats = Heartbeats(nc, WINDOW_S, clock)
    beats.heard("scheduler")
    assert _watch(beats, clock, WINDOW_S * 0.5) == []
    clock.advance(WINDOW_S * 2)  # the event loop held up, as a busy gateway's can be: its heartbeats wait in the queue
    assert beats.silent() == []  # the first look after the stall opens a fresh window
    assert beats.in_grace("scheduler")
    beats.heard("scheduler")  # the queued heartbeat, processed (the fresh window still counts from the stall)
    assert _watch(beats, clock, WINDOW_S * 2) == []
    assert _watch(beats, clock, LOOK_S) == ["scheduler"]  # and then its silence counts again
    await nc.close()


async def _answered(probe: BusProbe, clock: ManualClock) -> None:
    """Until a PING the probe sent at the clock's present time is answered."""
    async with asyncio.timeout(10):
        while probe.answered_at != clock():
            await asyncio.sleep(0.01)


async def test_a_paused_server_is_our_outage_not_the_peers_silence(server):
    """SIGSTOP keeps our TCP connection open (we stay "connected"): only the probe's unanswered PING
    tells that the bus, not the peer, went quiet."""
    nc = await nats.connect(server.url)
    clock = ManualClock()
    probe = BusProbe(nc, clock).start()
    beats = Heartbeats(nc, WINDOW_S, clock, probe=probe)
    beats.heard("scheduler")
    # a PING may be in flight at the pause and its PONG read only after the clock moved on: the probe
    # counts it from when it was sent (CI twice saw the scheduler declared silent when it counted the read)
    await _answered(probe, clock)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(round(WINDOW_S * 3 / LOOK_S)):
            clock.advance(LOOK_S)
            await asyncio.sleep(0)  # the probe's turn: its PING goes unanswered
            assert nc.is_connected and beats.silent() == []
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    await _answered(probe, clock)
    assert beats.silent() == [] and beats.in_grace("scheduler")  # the bus is back: a fresh window
    for _ in range(round(WINDOW_S * 2 / LOOK_S)):
        clock.advance(LOOK_S)
        await _answered(probe, clock)
        assert beats.silent() == []
    clock.advance(LOOK_S)
    await _answered(probe, clock)
    assert beats.silent() == ["scheduler"]  # the bus answers and the peer does not: silent
    probe.stop()
    await nc.close()


async def test_a_pong_read_late_counts_from_when_its_ping_left(server):
    """The bus was known alive when the PING left, not when its PONG was read: a PONG read after a
    pause began (or after our loop was held up) must not say the bus answered during it."""
    nc = await nats.connect(server.url)
    clock = ManualClock()
    probe = BusProbe(nc, clock)
    clock.advance(1.0)
    probe.start()
    await asyncio.sleep(0)  # the probe's first step: its PING leaves at 1001
    clock.advance(6.0)  # and its PONG is read no earlier than 1007
    async with asyncio.timeout(10):
        while probe.answered_at == 1000.0:
            await asyncio.sleep(0.01)
    assert probe.answered_at == 1001.0 and probe.quiet_for() == 6.0
    probe.stop()
    await nc.close()
