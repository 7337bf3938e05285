"""A clock the test moves by hand, for the classes that take one (Heartbeats, Replicas): no sleeps, no windows."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
