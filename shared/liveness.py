"""Who is still there: the last heartbeat of each peer, silence counted only while we are on the bus."""

from __future__ import annotations

import time
from collections.abc import Callable

from nats.aio.client import Client

SCHEDULER_HEARTBEAT_S = 0.5  # each scheduler process says it is alive this often...
SCHEDULER_SILENCE_S = 2.0  # ...and bus clients end its requests' streams after this long without
CLIENT_HEARTBEAT_S = 1.0  # each bus client (gateway) says it is alive this often...
CLIENT_SILENCE_S = 10.0  # ...and schedulers abort its requests after this long without (a busy loop lags)
WORKER_SILENCE_S = 5.0  # a worker heartbeats every second; this long without, it is gone


class Heartbeats:
    """A peer is silent once nothing was heard from it for `silence_s` while this client was
    connected. An outage of our own connection (a NATS restart) is not the peers' silence: while it
    lasts no one is declared gone, and after it every peer gets twice the window to be heard again
    (each client reconnects on its own schedule). Nor is a stall of our own event loop: when the
    looks come further apart than half the window, every peer gets a fresh window too."""

    def __init__(self, nc: Client, silence_s: float, clock: Callable[[], float] = time.monotonic):
        """clock: seconds that only go forward (tests pass one they move by hand)."""
        self.nc = nc
        self.silence_s = silence_s
        self.clock = clock
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
        if not self.nc.is_connected:
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
