"""One worker pool: its scheduler and the iteration loop that drives its worker over the bus.

    plan = scheduler.schedule(); result = await step(plan); finished = scheduler.update(plan, result)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.reply import publish_error
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.slot_manager import SlotManager
from services.scheduler.slot_scheduler import SlotScheduler
from shared import subjects
from shared.config import EngineConfig
from shared.hashing import root_hash
from shared.log import get_logger
from shared.messages import (
    ITERATION_TOKEN_BUCKETS,
    STEP_RESULT_DECODER,
    BlockStored,
    KvEventBatch,
    PoolCleared,
    Step,
    StepResult,
    WorkerHello,
    WorkerKind,
    encode,
)

log = get_logger("scheduler.pool")


class WorkerGone(Exception):
    pass


def _scheduler_for(hello: WorkerHello, config: EngineConfig, root: bytes, can_run_more) -> Scheduler:
    """Blocks for a paged worker; for a slots worker (static shapes), its slots and chunk size."""
    if hello.kind == WorkerKind.SLOTS:
        return SlotScheduler(SlotManager(hello.num_blocks, hello.block_size), hello.prefill_seq_len, can_run_more,
                             num_scheduler_steps=config.num_scheduler_steps)
    kv = KVCacheManager(hello.num_blocks, hello.block_size, root, enable_prefix_caching=config.enable_prefix_caching)
    return Scheduler(kv, min(config.max_num_seqs, hello.max_batch), config.max_num_batched_tokens, can_run_more,
                     is_static=config.batching == "static", num_scheduler_steps=config.num_scheduler_steps)


class PoolLoop:
    def __init__(self, nc: Client, hello: WorkerHello, config: EngineConfig,
                 on_gone: Callable[[PoolLoop, list[Request]], Awaitable[None]],
                 can_run_more: Callable[[], bool]):
        self.nc = nc
        self.hello = hello
        self.worker_id = hello.worker_id
        self.step_timeout_s = config.step_timeout_s
        self.root_hash = root_hash(hello.model, hello.kv_cache_dtype)
        self.scheduler = _scheduler_for(hello, config, self.root_hash, can_run_more)
        self.on_gone = on_gone
        self.last_seen = time.monotonic()
        self.is_alive = True
        self._wake = asyncio.Event()
        self._has_stepped = False
        self._task: asyncio.Task | None = None
        self.num_steps = 0
        self.step_seconds = 0.0  # round trips, summed
        self.forward_seconds = 0.0  # of which the worker spent in the step
        self.iteration_tokens = [0] * len(ITERATION_TOKEN_BUCKETS)  # cumulative, per bucket
        self.iteration_tokens_sum = 0
        self.iteration_tokens_count = 0

    # ---- requests ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._wake.set()

    def abort(self, request_id: str) -> Request | None:
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._wake.set()
        return request

    @property
    def load(self) -> int:
        return self.scheduler.num_requests

    def can_take(self, num_tokens: int) -> bool:
        """A request of num_tokens (prompt + max_tokens) fits this worker's context and KV memory."""
        return num_tokens <= self.hello.max_model_len and self.scheduler.kv.can_ever_fit(num_tokens)

    # ---- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pool-{self.worker_id}")

    async def stop(self) -> None:
        self.is_alive = False
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        await self.publish_snapshot()
        while self.is_alive:
            if not self.scheduler.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = self.scheduler.schedule()
            if plan.is_empty:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                result = await self._step(plan.step)
            except WorkerGone as exc:
                await self._fail_over(str(exc))
                return
            if result.error:
                await self._fail_step(plan.num_new_tokens, result.error)
            else:
                self._count_iterations(plan.num_new_tokens, result)
                self.scheduler.update(plan, result)
            await self._publish_kv_events()

    async def _step(self, step: Step) -> StepResult:
        step.reset = not self._has_stepped  # the worker may hold state from a scheduler before us
        self._has_stepped = True
        started = time.perf_counter()
        try:
            msg = await self.nc.request(subjects.worker_step(self.worker_id), encode(step),
                                        timeout=self.step_timeout_s)
        except NoRespondersError:
            raise WorkerGone(f"worker {self.worker_id} is gone (no responders)") from None
        except (TimeoutError, NatsTimeoutError):
            raise WorkerGone(f"worker {self.worker_id} missed its step deadline ({self.step_timeout_s}s)") from None
        self.last_seen = time.monotonic()
        result = STEP_RESULT_DECODER.decode(msg.data)
        self.num_steps += 1
        self.step_seconds += time.perf_counter() - started
        self.forward_seconds += result.forward_seconds
        return result

    def _count_iterations(self, num_new_tokens: dict[str, int], result: StepResult) -> None:
        """Tokens per model iteration: the Step's first, then (multi-step) one per row still running."""
        per_row = Counter(s.request_id for s in result.sampled)
        tokens = [sum(num_new_tokens.values())]
        tokens += [sum(1 for n in per_row.values() if n > i) for i in range(1, max(per_row.values(), default=1))]
        for num in tokens:
            self.iteration_tokens_sum += num
            self.iteration_tokens_count += 1
            for b, bound in enumerate(ITERATION_TOKEN_BUCKETS):
                self.iteration_tokens[b] += num <= bound

    async def _fail_step(self, request_ids, error: str) -> None:
        log.error("step_error", worker_id=self.worker_id, error=error)
        for request_id in list(request_ids):
            request = self.scheduler.abort(request_id)
            if request is not None:
                await publish_error(self.nc, request, f"engine error: {error}")
        self.scheduler.take_dropped_ids()  # the worker already forgot them

    async def _fail_over(self, reason: str) -> None:
        """Fail what the worker held; hand back what was only waiting."""
        log.error("worker_gone", worker_id=self.worker_id, reason=reason)
        self.is_alive = False
        requeue = []
        for request in self.scheduler.take_all():
            if request.output_token_ids or request.is_on_worker:
                await publish_error(self.nc, request, reason)
            else:
                requeue.append(request)
        await self.nc.publish(subjects.kv_events(self.worker_id), encode(
            KvEventBatch(pool=self.worker_id, model=self.hello.model, events=[PoolCleared()])))
        await self.on_gone(self, requeue)

    async def fail_over(self, reason: str) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._fail_over(reason)

    # ---- KV events ---------------------------------------------------------------------------

    async def _publish_kv_events(self) -> None:
        events = self.scheduler.kv.take_events()
        if events:
            await self.nc.publish(subjects.kv_events(self.worker_id), encode(
                KvEventBatch(pool=self.worker_id, model=self.hello.model, events=events)))

    async def publish_snapshot(self) -> None:
        """PoolCleared then everything cached: how the KV index (re)learns this pool."""
        hashes = self.scheduler.kv.cached_hashes()
        events = [PoolCleared()] + ([BlockStored(block_hashes=hashes)] if hashes else [])
        await self.nc.publish(subjects.kv_events(self.worker_id), encode(
            KvEventBatch(pool=self.worker_id, model=self.hello.model, events=events)))
