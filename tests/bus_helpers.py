"""Asking the running stack over the bus, for tests."""

from __future__ import annotations

import asyncio

from shared.wire import subjects
from shared.wire.messages import encode
from shared.wire.stats import SCHEDULER_STATS_DECODER, SchedulerStats, SchedulerStatsRequest


async def scheduler_stats(nc, model: str) -> SchedulerStats:
    msg = await nc.request(subjects.scheduler_stats(model), encode(SchedulerStatsRequest()), timeout=2)
    return SCHEDULER_STATS_DECODER.decode(msg.data)


async def until(condition, timeout_s: float = 10.0) -> None:
    """Wait for a condition the bus makes true (a delivery we cannot subscribe to), not for a time."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)
