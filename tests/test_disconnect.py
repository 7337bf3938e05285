"""A client that goes away aborts its request: the scheduler frees its blocks at once."""

from __future__ import annotations

import asyncio

import httpx
import nats
import pytest

from shared import subjects
from shared.messages import SCHEDULER_STATS_DECODER, SchedulerStatsRequest, encode

pytestmark = pytest.mark.stack


async def stats(nc, model):
    msg = await nc.request(subjects.scheduler_stats(model), encode(SchedulerStatsRequest()), timeout=2)
    return SCHEDULER_STATS_DECODER.decode(msg.data)


async def test_dropped_streams_are_aborted(stack, model_name):
    nc = await nats.connect(stack.nats_url)
    body = {"model": model_name, "prompt": "Tell me a very long story", "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        async def open_and_drop():
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        return  # leaving the block closes the connection mid-stream

        await asyncio.gather(*(open_and_drop() for _ in range(4)))
    for _ in range(50):
        s = await stats(nc, model_name)
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0:
            break
        await asyncio.sleep(0.1)
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    await nc.close()
