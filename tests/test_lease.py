"""The leader lease on a real nats-server: when the leader dies, the standby that waited longest
takes over, not the dead leader's restarted process (it defers), within the lease's TTL."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.scheduler import lease as lease_module
from services.scheduler.lease import LEASE_S, Lease
from switchyard.nats_server import NatsServer

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def bus():
    server = NatsServer().start()
    yield server
    server.stop()


async def test_the_standby_that_waited_longest_leads_after_the_leader_dies(bus):
    conns = [await nats.connect(bus.url) for _ in range(3)]
    leader, standby, restarted = (Lease(nc, "probe", holder=name) for nc, name in zip(
        conns, ("leader", "standby", "restarted"), strict=True))
    try:
        assert await leader.acquire() >= 1
        waiting = asyncio.create_task(standby.acquire())
        await asyncio.sleep(lease_module.TRY_S * 4)  # it has found the key held
        leader._renewing.cancel()  # the leader dies: nobody renews, nobody deletes
        died = time.monotonic()
        await asyncio.sleep(2)  # its supervisor starts it again, as a standby
        late = asyncio.create_task(restarted.acquire())
        token = await asyncio.wait_for(waiting, LEASE_S + 5)
        took = time.monotonic() - died
        assert not late.done()
        assert token > leader.token
        assert took <= LEASE_S + 2 * lease_module.RENEW_S  # the TTL from its last renewal, and a try
        print(f"takeover {took:.2f}s after the leader's last word")
    finally:
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task() and task.get_coro().__qualname__.startswith("Lease."):
                task.cancel()
        for nc in conns:
            await nc.close()
