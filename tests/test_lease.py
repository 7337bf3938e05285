"""The leader lease on a real nats-server: when the leader dies, the standby that waited longest
takes over, not the dead leader's restarted process (it defers), within the lease's TTL; a leader a
worker refuses raises its token only while the key is its own."""

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


async def _leave(conns) -> None:
    """Every lease's renewal and acquiring stopped (the processes they stand for gone), the connections closed."""
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task() and task.get_coro().__qualname__.startswith("Lease."):
            task.cancel()
    for nc in conns:
        await nc.close()


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
        await _leave(conns)


class Deposed(Exception):
    pass


async def test_a_refused_leader_whose_key_is_still_its_own_raises_its_token_and_a_deposed_one_exits(bus, monkeypatch):
    """A worker that saw a token above ours (the bucket's revisions went back after a NATS node's
    loss): our renewal succeeds, so the token rises past the worker's. Once another scheduler has
    the key, the same refusal deposes us (the renewal fails)."""
    def exit_(reason):
        raise Deposed(reason)
    monkeypatch.setattr(lease_module, "deposed", exit_)
    conns = [await nats.connect(bus.url) for _ in range(2)]
    leader, other = Lease(conns[0], "overrule", holder="leader"), Lease(conns[1], "overrule", holder="other")
    try:
        token = await leader.acquire()
        await leader.overrule(token + 100, "a worker saw a newer token")
        assert leader.token == token + 101
        await leader.overrule(token + 50, "an older refusal, answered already")  # never lowers it
        assert leader.token == token + 101
        leader._renewing.cancel()
        kv = await leader._bucket()
        await kv.delete(leader.key)  # the key gone: the other scheduler takes it
        assert await other.acquire() > token
        with pytest.raises(Deposed, match="taken by another scheduler"):
            await leader.overrule(leader.token + 1, "the new leader's token")
    finally:
        await _leave(conns)
