"""Prompt blocks a prefill request left in the host tier for its decode request (vLLM's
kv_transfer_params, with which an outside router drives disaggregated prefill): kept from the tier's
LRU until the decode request has loaded them, or for HOLD_S at most."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.scheduler.host_tier import HostTiers, TierIndex
from services.scheduler.request import Request
from shared.log import get_logger
from shared.wire.kv_events import KvHeld, KvTransferParams

log = get_logger("scheduler.kv_holds")
HOLD_S = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: a decode request that never comes frees them then


def kv_transfer_error(params: KvTransferParams | None, tiers: list[TierIndex | None]) -> str | None:
    """Why an outside router's kv_transfer_params cannot be served by these pools (None: they can)."""
    if params is None or not (params.do_remote_decode or params.do_remote_prefill):
        return None
    if params.do_remote_decode and params.do_remote_prefill:
        return "kv_transfer_params: do_remote_decode and do_remote_prefill are a prefill's and a decode's, not both"
    if not any(tiers):
        return ("kv_transfer_params need the host KV tier, where the prefill's blocks wait for the decode: "
                "start the workers with --kv-offloading-size GIB")
    return None


@dataclass
class Hold:
    tier: TierIndex
    block_hashes: list[bytes]
    expires_at: float
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # the Step writing its last blocks is back

    def where(self) -> KvHeld:
        """The tier's slots of its blocks, from the first, as far as the tier holds them."""
        slots = []
        for block_hash in self.block_hashes:
            slot = self.tier.lookup(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return KvHeld(tier_id=self.tier.tier_id, slots=slots)


class KvHolds:
    def __init__(self):
        self._holds: dict[str, Hold] = {}
        self._waiters: dict[str, asyncio.Event] = {}  # a gateway asked before the request's end was taken

    def hold(self, request_id: str, tier: TierIndex, block_hashes: list[bytes], now: float) -> Hold:
        self.release(request_id)
        hold = self._holds[request_id] = Hold(tier, block_hashes, now + HOLD_S)
        tier.protect(block_hashes)
        if (waiter := self._waiters.pop(request_id, None)) is not None:
            waiter.set()
        return hold

    async def answer(self, request_id: str, timeout_s: float) -> KvHeld:
        """Where the request's blocks are once the Step that saves the last of them is back. The
        worker streams its last token as the scheduler takes the Step: a question may come first."""
        try:
            async with asyncio.timeout(timeout_s):
                if request_id not in self._holds:
                    await self._waiters.setdefault(request_id, asyncio.Event()).wait()
                hold = self._holds.get(request_id)
                if hold is None:
                    return KvHeld(error=f"no blocks are held for request {request_id!r}")
                await hold.settled.wait()
        except TimeoutError:
            self._waiters.pop(request_id, None)
            return KvHeld(error=f"no blocks were held for request {request_id!r} within {timeout_s:g}s")
        return hold.where()

    def missing(self, request: Request, tiers: HostTiers) -> None:
        """A decode request whose prefill's blocks nobody holds (expired, another deployment's, a
        scheduler that failed over) recomputes what the pools and tiers lack: logged with what its
        params named, so an operator sees why."""
        params = request.kv_transfer
        if params is None or not request.held_for or request.held_for in self._holds:
            return
        log.warning("kv_transfer_not_held", request_id=request.request_id, remote_request_id=request.held_for,
                    remote_engine_id=params.remote_engine_id, num_remote_blocks=len(params.remote_block_ids),
                    tier_known=any(t.tier_id == params.remote_engine_id for t in tiers))

    def release(self, request_id: str) -> None:
        """The decode request loaded them (or the hold expired): the tier's LRU may take them again."""
        hold = self._holds.pop(request_id, None)
        if hold is not None:
            hold.tier.unprotect(hold.block_hashes)

    def expire(self, now: float) -> None:
        for request_id in [r for r, hold in self._holds.items() if hold.expires_at <= now]:
            log.warning("kv_hold_expired", request_id=request_id, hold_s=HOLD_S)
            self.release(request_id)

    def __len__(self) -> int:
        return len(self._holds)
