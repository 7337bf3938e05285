"""vLLM's sleep mode for one model's pools: park each loop, then each worker frees its weights and KV
pool; waking loads them back, then the loops resume with the requests that waited."""

from __future__ import annotations

import asyncio

from services.scheduler.pool import PoolLoop
from shared.log import get_logger
from shared.wire.sleep import Sleep, SleepState, WakeUp

log = get_logger("scheduler.sleep")


class ModelSleep:
    """Whether the model sleeps, and at what level (vLLM's engine_sleep_state); one order at a time."""

    def __init__(self, model: str, timeout_s: float):
        self.model = model
        self.timeout_s = timeout_s
        self.is_sleeping = False
        self.level = 0
        self._lock = asyncio.Lock()

    async def order(self, order: Sleep | WakeUp, pools: list[PoolLoop]) -> SleepState:
        async with self._lock:
            error = None
            if isinstance(order, Sleep) and not self.is_sleeping:
                self.is_sleeping, self.level = True, order.level
                log.info("model_sleeping", model=self.model, level=order.level, num_workers=len(pools))
                error = await put_to_sleep(pools, order, self.timeout_s)
            elif isinstance(order, WakeUp) and self.is_sleeping:
                error = await wake_up(pools)
                self.is_sleeping, self.level = False, 0
                log.info("model_awake", model=self.model, num_workers=len(pools))
        return SleepState(is_sleeping=self.is_sleeping, error=error)

    def joined(self, pool: PoolLoop) -> None:
        """A worker that joins a sleeping model sleeps too, and wakes with the others."""
        if self.is_sleeping:
            asyncio.get_running_loop().create_task(put_to_sleep([pool], Sleep(), self.timeout_s))


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
