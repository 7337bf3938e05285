"""A client that goes away aborts its request: the scheduler frees its blocks at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats
import pytest

from tests.bus_helpers import scheduler_stats

pytestmark = pytest.mark.stack


async def test_fifty_dropped_streams_leave_the_engine_idle(stack, model_name):
    nc = await nats.connect(stack.admin_url)
    body = {"model": model_name, "prompt": "Tell me a very long story", "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60, limits=limits) as client:
        opened = asyncio.Event()
        num_open = 0
        busy = None

        async def open_and_drop():
            nonlocal num_open, busy
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()  # held, not broken out of: a finalized iterator closes the stream
                while not (await lines.__anext__()).startswith("data:"):
                    pass
                num_open += 1
                if num_open == 50:
                    busy = await scheduler_stats(nc, model_name)
                    opened.set()
                await opened.wait()  # every stream is generating before any is dropped
            # leaving the block closes the connection mid-stream

        await asyncio.gather(*(open_and_drop() for _ in range(50)))
    dropped_at = time.monotonic()
    assert busy.num_running + busy.num_waiting == 50 and busy.kv_cache_usage > 0
    while time.monotonic() - dropped_at < 10:
        s = await scheduler_stats(nc, model_name)
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0:
            break
        await asyncio.sleep(0.05)
    idle_after = time.monotonic() - dropped_at
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    print(f"\n50 dropped streams: engine idle {idle_after:.2f}s after the last drop")
    await nc.close()
