"""Leadership among scheduler processes: a JetStream KV lease whose revision is the fencing token.

The first to create the key leads; it renews the key (a compare-and-set on its last revision) every
RENEW_S, and the bucket's TTL drops a key nobody renews, so a standby takes the lease LEASE_S after
its leader died. A leader that fails a renewal exits at once without a word to anyone (`deposed`):
its requests belong to the new leader now. A worker refuses a Step whose token is below the newest
it has seen; the leader then renews at once: failing, it is deposed; succeeding, the key is still
ours and the bucket's revisions went back (a JetStream node lost its last writes), so our token
rises past the worker's (`overrule`).
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import NoReturn

from nats.aio.client import Client
from nats.js.api import StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from shared.bus import replicas
from shared.log import get_logger

log = get_logger("scheduler")
LEASES_BUCKET = "sy-leases"
# a leader silent this long loses the lease (the bucket's TTL): longer than JetStream takes to
# elect the bucket a new leader when a NATS node dies (a few seconds), or a node's loss would
# depose a healthy leader; Kubernetes' leader election picks the same order (15 s)
LEASE_S = 10.0
RENEW_S = 2.0
TRY_S = 0.25  # a standby asks this often
# a standby that first saw the lease held less than LEASE_S ago (the dead leader, just restarted by its
# supervisor) waits this much longer once the key is gone, so the one that stood by longest leads
YOUNG_DEFER_S = 1.0
DEPOSED_EXIT = 3  # the exit status of a leader that lost its lease (its supervisor starts it again, as a standby)


def deposed(reason: str) -> NoReturn:
    """Another scheduler leads: stop now, publishing nothing (no error entries, no drain)."""
    log.error("scheduler_deposed", reason=reason)
    os._exit(DEPOSED_EXIT)


class Lease:
    def __init__(self, nc: Client, name: str, holder: str | None = None):
        self.nc = nc
        self.key = f"scheduler.{name}"
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}"
        self.token = 0  # the revision we created the key at: grows with every new leader
        self._revision = 0
        self._kv = None
        self._renewing: asyncio.Task | None = None
        self._writing = asyncio.Lock()  # one compare-and-set at a time, or ours would fail each other
        self._renewed_at = 0.0

    async def _bucket(self):
        if self._kv is None:
            js = self.nc.jetstream()
            try:
                self._kv = await js.key_value(LEASES_BUCKET)
            except BucketNotFoundError:
                self._kv = await js.create_key_value(bucket=LEASES_BUCKET, history=1, ttl=LEASE_S,
                                                     storage=StorageType.FILE, replicas=replicas())
        return self._kv

    async def acquire(self) -> int:
        """Wait until we lead (as a standby meanwhile); returns the fencing token. The standby that
        has waited longest goes first: a young one (the dead leader restarted) defers to it."""
        loop = asyncio.get_running_loop()
        held_since: float | None = None  # when we first found the key held by another
        while True:
            try:
                kv = await self._bucket()
                if held_since is not None and loop.time() - held_since < LEASE_S and not await self._is_held(kv):
                    await asyncio.sleep(YOUNG_DEFER_S)  # gone: an older standby has this long to take it
                self._revision = self.token = await kv.create(self.key, self.holder.encode())
                break
            except KeyWrongLastSequenceError:
                if held_since is None:
                    held_since = loop.time()
                    log.info("scheduler_standby", lease=self.key, holder=self.holder)
            except Exception as exc:  # the bus or JetStream not there yet: a standby waits either way
                log.warning("lease_unavailable", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(TRY_S)
        self._renewed_at = loop.time()
        log.info("lease_acquired", lease=self.key, holder=self.holder, token=self.token)
        self._renewing = asyncio.get_running_loop().create_task(self._renew())
        return self.token

    async def _is_held(self, kv) -> bool:
        try:
            return (await kv.get(self.key)) is not None
        except KeyNotFoundError:
            return False

    async def _renew(self) -> None:
        """Keep the key ours."""
        while True:
            await asyncio.sleep(RENEW_S)
            await self._renew_once(retry=False)

    async def _renew_once(self, retry: bool) -> None:
        """One compare-and-set on our last revision; the key taken deposes us, and so does a bus
        away for as long as the lease lasts. retry: try again until then, rather than return."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with self._writing:
                    self._revision = await self._kv.update(self.key, self.holder.encode(), last=self._revision)
                self._renewed_at = loop.time()
                return
            except KeyWrongLastSequenceError:
                deposed(f"the lease {self.key} was taken by another scheduler")
            except Exception as exc:  # the bus away: retry while the lease may still be ours
                log.warning("lease_renew_failed", error=f"{type(exc).__name__}: {exc}")
                if loop.time() - self._renewed_at > LEASE_S:
                    deposed(f"the lease {self.key} could not be renewed for {LEASE_S:g}s")
            if not retry:
                return
            await asyncio.sleep(TRY_S)

    async def overrule(self, newest: int, refusal: str) -> None:
        """A worker refused our Step, having seen token `newest` above ours. A renewal now says
        whether the key is still ours (else we are deposed); if it is, the token that worker saw
        was a leader's before us at a revision the bucket has since lost, and ours rises past it."""
        await self._renew_once(retry=True)
        if newest >= self.token:
            log.warning("lease_token_raised", lease=self.key, token=newest + 1, was=self.token, refusal=refusal)
            self.token = newest + 1

    async def release(self) -> None:
        """Leaving: the key deleted (if still ours), so a standby need not wait out the TTL."""
        if self._renewing is not None:
            self._renewing.cancel()
            self._renewing = None
            try:
                await self._kv.delete(self.key, last=self._revision)
            except Exception as exc:  # taken already, or the bus away: the TTL ends it
                log.warning("lease_release_failed", error=f"{type(exc).__name__}: {exc}")
