"""vLLM's sleep mode for one model's pools: park each loop, then each worker frees its weights and KV
pool; waking loads them back, then the loops resume with the requests that waited."""

from __future__ import annotations

import asyncio

from services.scheduler.pool import PoolLoop
from shared.log import get_logger
from shared.wire.messages import Sleep, SleepState, WakeUp

log = get_logger("scheduler.sleep")


async def put_to_sleep(pools: list[PoolLoop], order: Sleep, timeout_s: float) -> str | None:
    """None once every worker sleeps, else what went wrong (the pools stay parked: WakeUp resumes them)."""
    await asyncio.wait_for(asyncio.gather(*(pool.park() for pool in pools)), timeout_s)
    return _failures(pools, await asyncio.gather(*(pool.order_worker(order) for pool in pools),
                                                 return_exceptions=True))


async def wake_up(pools: list[PoolLoop]) -> str | None:
    """Each worker loads its weights and KV pool back, then its loop resumes (whatever the others say)."""
    answers = await asyncio.gather(*(pool.order_worker(WakeUp()) for pool in pools), return_exceptions=True)
    for pool in pools:
        pool.resume()
    return _failures(pools, answers)


def _failures(pools: list[PoolLoop], answers: list) -> str | None:
    errors = []
    for pool, answer in zip(pools, answers, strict=True):
        if isinstance(answer, BaseException):
            errors.append(f"worker {pool.worker_id}: {type(answer).__name__}: {answer}")
        elif isinstance(answer, SleepState) and answer.error:
            errors.append(f"worker {pool.worker_id}: {answer.error}")
    if errors:
        log.error("sleep_mode_failed", errors=errors)
    return "; ".join(errors) or None
