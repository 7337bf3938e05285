"""Who is still there: the last heartbeat of each peer, silence counted only while we are on the bus."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable

from nats.aio.client import Client

SCHEDULER_HEARTBEAT_S = 0.5  # each scheduler process says it is alive this often...
SCHEDULER_SILENCE_S = 2.0  # ...and bus clients end its requests' streams after this long without
CLIENT_HEARTBEAT_S = 1.0  # each bus client (gateway) says it is alive this often...
CLIENT_SILENCE_S = 10.0  # ...and schedulers abort its requests after this long without (a busy loop lags)
WORKER_SILENCE_S = 5.0  # a worker heartbeats every second; this long without, it is gone
PROBE_EVERY_S = 0.25  # our own round trip through the server (PING/PONG), this often


class BusProbe:
    """Whether the bus answers us: a PING/PONG with our server every PROBE_EVERY_S. A server that is
    paused or cut off keeps our TCP connection open (we stay "connected"), so only a round trip tells
    a stalled bus, which silences every peer at once, from one peer's silence."""

    def __init__(self, nc: Client, clock: Callable[[], float] = time.monotonic):
        self.nc = nc
        self.clock = clock
        self.answered_at = clock()
        self._task: asyncio.Task | None = None

    @classmethod
    def of(cls, nc: Client) -> BusProbe:
        """The one probe of this connection (every Heartbeats on it shares it)."""
        if (probe := _PROBES.get(nc)) is None:
            probe = _PROBES[nc] = cls(nc)
        return probe

    def start(self) -> BusProbe:
        """Idempotent; from the event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def quiet_for(self) -> float:
        """Seconds since the bus was last known to answer: since our last answered PING was sent."""
        return self.clock() - self.answered_at

    async def _run(self) -> None:
        while not self.nc.is_closed:
            try:
                sent = self.clock()
                await self.nc.flush(timeout=60)  # waits out a stall: answered when the server runs again
                # the PONG proves the bus alive when the PING left, no later: one read late (a loop
                # held up, a PONG sent just before a pause) must not say it answered afterwards
                self.answered_at = sent
            except Exception:  # disconnected or closed: nc.is_connected says so meanwhile
                pass
            await asyncio.sleep(PROBE_EVERY_S)


_PROBES: weakref.WeakKeyDictionary[Client, BusProbe] = weakref.WeakKeyDictionary()


class Heartbeats:
    """A peer is silent once nothing was heard from it for `silence_s` while this client was
    connected. An outage of our own connection (a NATS restart) is not the peers' silence: while it
    lasts no one is declared gone, and after it every peer gets twice the window to be heard again
    (each client reconnects on its own schedule). Nor is a stall of our own event loop: when the
    looks come further apart than half the window, every peer gets a fresh window too. With a
    probe, a bus that stops answering our PINGs for half the window (a paused or partitioned server)
    is our outage as well."""

    def __init__(self, nc: Client, silence_s: float, clock: Callable[[], float] = time.monotonic,
                 probe: BusProbe | None = None):
        """clock: seconds that only go forward (tests pass one they move by hand).
        probe: the process's BusProbe, started (None: the connection's state alone tells outages)."""
        self.nc = nc
        self.silence_s = silence_s
        self.clock = clock
        self.probe = probe
        self.last_seen: dict[str, float] = {}
        self._reconnects = nc.stats["reconnects"]
        self._was_down = False
        self._last_look = clock()

    def heard(self, peer: str) -> None:
        self.last_seen[peer] = max(self.last_seen.get(peer, 0.0), self.clock())

    def forget(self, peer: str) -> None:
        self.last_seen.pop(peer, None)

    def __contains__(self, peer: str) -> bool:
        return peer in self.last_seen

    def silent(self) -> list[str]:
        """The peers gone quiet (call it every fraction of silence_s; it also notices our outages)."""
        if not self._is_up():
            return []
        now = self.clock()
        return [peer for peer, seen in self.last_seen.items() if now - seen > self.silence_s]

    def in_grace(self, peer: str) -> bool:
        """Just after our own outage, while the peer has had no fair chance to be heard again."""
        self._is_up()
        return self.last_seen.get(peer, 0.0) > self.clock()

    def _is_up(self) -> bool:
        """False while we are cut off; after an outage, every peer's window restarts (twice as long)."""
        if not self.nc.is_connected or (self.probe is not None and self.probe.quiet_for() > self.silence_s / 2):
            self._was_down = True
            return False
        now = self.clock()
        stalled, self._last_look = now - self._last_look > self.silence_s / 2, now
        if self._was_down or stalled or self.nc.stats["reconnects"] != self._reconnects:
            # our outage, or our own event loop held up (its heartbeats may still wait in our queue)
            self._was_down, self._reconnects = False, self.nc.stats["reconnects"]
            for peer in self.last_seen:
                self.last_seen[peer] = now + self.silence_s
        return True
