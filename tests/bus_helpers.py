"""Asking the running stack over the bus, for tests."""

from __future__ import annotations

from shared import subjects
from shared.messages import SCHEDULER_STATS_DECODER, SchedulerStats, SchedulerStatsRequest, encode


async def scheduler_stats(nc, model: str) -> SchedulerStats:
    msg = await nc.request(subjects.scheduler_stats(model), encode(SchedulerStatsRequest()), timeout=2)
    return SCHEDULER_STATS_DECODER.decode(msg.data)
