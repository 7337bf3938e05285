"""A histogram as it travels on the bus: what a scheduler observes, what a gateway exposes."""

from __future__ import annotations

import msgspec


class HistogramCounts(msgspec.Struct):
    """A histogram as Prometheus keeps one: cumulative counts at each upper bound, their sum and count."""

    bounds: list[float]
    counts: list[int]
    sum: float = 0.0
    count: int = 0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> HistogramCounts:
        return cls(bounds=list(bounds), counts=[0] * len(bounds))

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            self.counts[i] += value <= bound

    @classmethod
    def total(cls, parts: list[HistogramCounts], bounds: tuple[float, ...]) -> HistogramCounts:
        out = cls.empty(bounds)
        for part in parts:
            out.counts = [a + b for a, b in zip(out.counts, part.counts, strict=True)]
            out.sum += part.sum
            out.count += part.count
        return out
