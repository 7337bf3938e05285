"""Heartbeats over a real nats-server that goes away: our own outage, or our own stall, is nobody's silence."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from shared.liveness import Heartbeats
from switchyard.nats_server import NatsServer

pytestmark = pytest.mark.stack
WINDOW_S = 0.3


async def _until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


async def _watch(beats: Heartbeats, seconds: float) -> list[str]:
    """Look as a watch loop does (every 20 ms, a fraction of the window) for `seconds`; the last answer."""
    deadline = time.monotonic() + seconds
    silent = beats.silent()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        silent = beats.silent()
    return silent


async def test_a_peer_falls_silent_after_the_window_and_an_outage_does_not_count():
    server = NatsServer().start()
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    beats = Heartbeats(nc, WINDOW_S)
    beats.heard("worker")
    assert beats.silent() == []
    assert await _watch(beats, WINDOW_S * 1.5) == ["worker"]  # connected and nothing heard: silent

    beats.heard("worker")
    server.proc.kill()
    server.proc.wait()
    await _until(lambda: not nc.is_connected)
    assert await _watch(beats, WINDOW_S * 3) == []  # far past the window, but we are the ones cut off
    server.start()  # same port: the client comes back by itself
    await _until(lambda: nc.is_connected)
    assert await _watch(beats, WINDOW_S * 1.5) == []  # after the outage: twice the window to be heard again
    assert await _watch(beats, WINDOW_S * 1.2) == ["worker"]
    await nc.close()
    server.stop()


async def test_a_stall_of_our_own_loop_is_not_the_peers_silence():
    server = NatsServer().start()
    nc = await nats.connect(server.url)
    beats = Heartbeats(nc, WINDOW_S)
    beats.heard("scheduler")
    assert await _watch(beats, WINDOW_S * 0.5) == []
    time.sleep(WINDOW_S * 2)  # the event loop held up, as a busy gateway's can be: its heartbeats wait in the queue
    assert beats.silent() == []  # the first look after the stall opens a fresh window
    beats.heard("scheduler")  # the queued heartbeat, processed
    assert await _watch(beats, WINDOW_S * 0.5) == []
    await nc.close()
    server.stop()
