"""One worker pool: its scheduler and the iteration loop that drives its worker over the bus.

    plan = scheduler.schedule(); result = await step(plan); finished = scheduler.update(plan, result)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from services.scheduler import kv_publish
from services.scheduler.engine_metrics import EngineMetrics
from services.scheduler.host_tier import TierIndex
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.kv_holds import Hold, KvHolds
from services.scheduler.lease import Lease, deposed
from services.scheduler.reply import publish_error
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.slot_manager import SlotManager
from services.scheduler.slot_scheduler import SlotScheduler
from services.scheduler.static_scheduler import StaticScheduler
from shared.bus.liveness import Heartbeats
from shared.config import EngineConfig
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.hashing import root_hash
from shared.wire.lora import LORA_STATE_DECODER, LoraOrder, LoraState
from shared.wire.messages import (
    STEP_RESULT_DECODER,
    FinishReason,
    Step,
    StepResult,
    WorkerHello,
    WorkerKind,
    encode,
)
from shared.wire.sleep import SLEEP_STATE_DECODER, Sleep, SleepState, WakeUp

log = get_logger("scheduler.pool")
OUTAGE_POLL_S = 0.1  # how often a Step in flight looks whether the bus came back


class WorkerGone(Exception):
    pass


def _settle(holds: list[Hold]) -> None:
    """The Step that saved their last blocks is back (or failed: they hold what the tier has)."""
    for hold in holds:
        hold.settled.set()


def _scheduler_for(hello: WorkerHello, config: EngineConfig, can_run_more, tier: TierIndex | None) -> Scheduler:
    """Blocks for a paged worker; for a slots worker (static shapes), its slots and chunk size."""
    num_steps = config.num_scheduler_steps or hello.num_scheduler_steps  # 0: the worker knows its step's cost
    if hello.kind == WorkerKind.SLOTS:
        return SlotScheduler(SlotManager(hello.num_blocks, hello.block_size), hello.prefill_seq_len, can_run_more,
                             num_scheduler_steps=num_steps)
    kv = KVCacheManager(hello.num_blocks, hello.block_size, root_hash(hello.model, hello.kv_cache_dtype),
                        enable_prefix_caching=config.enable_prefix_caching, tier=tier)
    kind = StaticScheduler if config.batching == "static" else Scheduler
    return kind(kv, min(config.max_num_seqs, hello.max_batch), config.max_num_batched_tokens, can_run_more,
                num_scheduler_steps=num_steps, long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_loras=hello.max_loras, num_speculative_tokens=hello.num_speculative_tokens,
                spec_max_batch=hello.spec_max_batch)


class PoolLoop:
    def __init__(self, nc: Client, hello: WorkerHello, config: EngineConfig,
                 on_gone: Callable[[PoolLoop, list[Request]], Awaitable[None]],
                 can_run_more: Callable[[], bool], workers: Heartbeats, lease: Lease | None = None, tier: TierIndex | None = None,
                 on_handoff: Callable[[PoolLoop, list[Request]], Awaitable[None]] | None = None,
                 has_decoder: Callable[[], bool] = lambda: False, holds: KvHolds | None = None):
        """workers: where this pool's worker is heard from (its heartbeats and its step replies).
        lease: our leadership (lease.py), its token on every Step; None: no lease, token 0.
        tier: the index of the host KV tier the worker maps (host_tier.py), shared with its peers there.
        on_handoff: where a prefill worker's (kv_producer) requests go on at their first token, while
        has_decoder() says a decode worker is alive; None: they stay.
        holds: the prompt blocks prefill requests left in the tier for an outside router's decode requests."""
        self.nc = nc
        self.hello = hello
        self.worker_id = hello.worker_id
        self.step_timeout_s = config.step_timeout_s
        self.worker_bus_epoch = 0  # the worker's reconnects, as its heartbeat says (_request)
        self.lease = lease
        self.max_migrations = config.max_migrations
        self.tier = tier
        self.scheduler = _scheduler_for(hello, config, can_run_more, tier)
        self.on_gone = on_gone
        self.on_handoff = on_handoff if hello.kv_role == "kv_producer" else None
        self.has_decoder = has_decoder
        self._handoffs: list[Request] = []  # left this pool at their first token; the next Step saves their blocks
        self.holds = holds
        self._holding: list[Hold] = []  # held by requests that ended in the last Step: the next one saves their blocks
        self.workers = workers
        workers.heard(self.worker_id)
        self.is_alive = True
        self._wake = asyncio.Event()
        self._park_asked = False  # sleep mode: the loop parks before its next step
        self.between_steps = asyncio.Event()  # no Step out: every result taken into the metrics
        self.between_steps.set()
        self._parked = asyncio.Event()
        self._resume = asyncio.Event()
        self._has_stepped = False
        self._task: asyncio.Task | None = None
        self.steps_run = 0
        self.step_seconds = 0.0  # round trips, summed
        self.forward_seconds = 0.0  # of which the worker spent in the step
        self.metrics = EngineMetrics()

    # ---- requests ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._wake.set()

    def abort(self, request_id: str) -> Request | None:
        handing_off = next((r for r in self._handoffs if r.request_id == request_id), None)
        if handing_off is not None:
            self._handoffs.remove(handing_off)
            return handing_off
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._wake.set()
        return request

    @property
    def load(self) -> int:
        return self.scheduler.num_requests

    @property
    def loras_in_use(self) -> set[str]:
        """The adapters of its requests: in its worker's slots while they run."""
        return {r.lora for r in self.scheduler.requests.values() if r.lora is not None}

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
        """The loop, supervised: should it fail (a bug, a bus error), its worker's requests are not
        left on a loop that no longer steps: they move as after the worker's death, and the worker,
        alive, is taken back as a new pool at its next heartbeat (an unknown worker is asked to say
        hello)."""
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - logged with its traceback; the requests go on elsewhere
            log.exception("pool_loop_failed", worker_id=self.worker_id)
            if self.is_alive:
                await self._fail_over(f"the scheduler's loop for worker {self.worker_id} failed: "
                                      f"{type(exc).__name__}: {exc}")

    async def _loop(self) -> None:
        await self.publish_snapshot()
        if not self.scheduler.has_work:  # a worker back after it was declared gone drops what it held now
            try:
                await self._step(Step(step_id=0))
            except WorkerGone as exc:
                await self._fail_over(str(exc))
                return
        while self.is_alive:
            if self._park_asked:
                await self._park()
                continue
            if not self.scheduler.has_work:  # no Step out, no block waiting to be saved
                _settle(self._holding)
                self._holding = []
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = self.scheduler.schedule()
            handing_off = list(self._handoffs)  # this Step writes the last of their blocks to the tier
            settling, self._holding = self._holding, []  # ... and of theirs
            if plan.is_empty:
                _settle(settling)
                await self._hand_off(handing_off)
                self._wake.clear()
                await self._wake.wait()
                continue
            self.between_steps.clear()
            try:
                result = await self._step(plan.step)
                self.scheduler.kv.end_transfers(ok=not result.error)
                if result.error:
                    await self._fail_step(plan.num_new_tokens, result.error)
                else:
                    await self._take(plan, result)
            except WorkerGone as exc:
                await self._fail_over(str(exc))
                return
            finally:
                self.between_steps.set()
                _settle(settling)
            await self._hand_off(handing_off)
            await self._publish_kv_events()

    async def _take(self, plan, result: StepResult) -> None:
        """A Step's result into the metrics and the scheduler's state; finished requests end."""
        rows = [r for rid in plan.num_new_tokens if (r := self.scheduler.requests.get(rid)) is not None]
        self.metrics.observe_step(rows, result)
        if self.holds is not None:
            for request in rows:  # its first Step loaded the prompt's blocks from the tier
                if request.held_for:
                    self.holds.release(request.held_for)
        for done in self.scheduler.update(plan, result):
            self.metrics.observe_finished(done.request)
            self._hold_for_decode(done.request, done.reason)
            if done.error is not None:
                log.error("request_failed", request_id=done.request.request_id, error=done.error)
                await publish_error(self.nc, done.request, f"engine error: {done.error}")
        if self.on_handoff is not None and self.has_decoder():
            self._begin_handoffs({s.request_id for s in result.sampled if s.token_id >= 0})

    # ---- disaggregated prefill ---------------------------------------------------------------------

    def _hold_for_decode(self, request: Request, reason: FinishReason) -> None:
        """An outside router's prefill request (do_remote_decode) that ended at its length: its
        prompt's full blocks stay in the tier for the decode request, as vLLM's connectors hold them."""
        params = request.kv_transfer
        if params is None or not params.do_remote_decode or reason != FinishReason.LENGTH or self.holds is None \
                or self.tier is None:
            return
        num_blocks = request.num_prompt_tokens // self.scheduler.kv.block_size
        self._holding.append(self.holds.hold(request.request_id, self.tier, request.block_hashes[:num_blocks],
                                             time.monotonic()))

    def _begin_handoffs(self, sampled: set[str]) -> None:
        """A prefill worker's requests that sampled a token leave it (the worker drops them at the
        next Step, which also writes the blocks they computed last to the host tier); they go on
        where on_handoff sends them once that Step is back, loading their prompt from the tier."""
        for request in [r for r in self.scheduler.running if r.request_id in sampled and r.kv_transfer is None]:
            self.scheduler.abort(request.request_id)
            request.migrate(counted=False)
            self._handoffs.append(request)

    async def _hand_off(self, requests: list[Request]) -> None:
        if requests:
            gone = {r.request_id for r in requests}
            self._handoffs = [r for r in self._handoffs if r.request_id not in gone]
            await self.on_handoff(self, requests)

    # ---- sleep mode ----------------------------------------------------------------------------

    async def park(self) -> None:
        """Returns once the loop stands between steps with nothing running (sleep mode)."""
        self._park_asked = True
        self._resume.clear()
        self._wake.set()
        await self._parked.wait()

    def resume(self) -> None:
        self._park_asked = False
        self._parked.clear()
        self._resume.set()

    async def order_lora(self, order: LoraOrder) -> LoraState:
        """The worker loads or lets go of a LoRA adapter; its answer lists what it serves after."""
        msg = await self.nc.request(subjects.worker_lora(self.worker_id), encode(order), timeout=self.step_timeout_s)
        self.workers.heard(self.worker_id)
        return LORA_STATE_DECODER.decode(msg.data)

    async def order_worker(self, order: Sleep | WakeUp) -> SleepState:
        """The worker frees (Sleep) or loads back (WakeUp) its weights and KV pool."""
        msg = await self.nc.request(subjects.worker_sleep(self.worker_id), encode(order), timeout=self.step_timeout_s)
        self.workers.heard(self.worker_id)
        return SLEEP_STATE_DECODER.decode(msg.data)

    async def _park(self) -> None:
        """Running requests back to waiting (recomputed after the wake, their tokens kept), the
        prefix cache forgotten (the worker frees the KV pool), the worker's sequences dropped by the
        next Step's reset; then the loop waits to be resumed."""
        self.scheduler.preempt_all()
        self.scheduler.kv.reset_prefix_cache()
        self._has_stepped = False
        await kv_publish.publish_cleared(self.nc, self.hello.model, self.worker_id)
        self._parked.set()
        await self._resume.wait()
        self._wake.set()

    async def _step(self, step: Step) -> StepResult:
        step.reset = not self._has_stepped  # the worker may hold state from a scheduler before us
        self._has_stepped = True
        started = time.perf_counter()
        while True:
            step.fence = self.lease.token if self.lease is not None else 0
            msg = await self._request(encode(step))
            self.workers.heard(self.worker_id)
            result = STEP_RESULT_DECODER.decode(msg.data)
            if result.restarted:  # a new process under the worker's id: what we stepped is gone with the old
                raise WorkerGone(f"worker {self.worker_id} restarted: {result.error}")
            if not result.fenced:
                break
            refusal = f"worker {self.worker_id} refused our Step: {result.error}"
            if self.lease is None or result.newest_fence <= step.fence:  # an older worker, or no lease of ours
                deposed(refusal)
            await self.lease.overrule(result.newest_fence, refusal)
        self.steps_run += 1
        self.step_seconds += time.perf_counter() - started
        self.forward_seconds += result.forward_seconds
        return result

    async def _request(self, payload: bytes):
        """The Step's round trip. A bus outage while it is out can lose the Step or the reply: once
        the bus is back it is sent again (the worker answers a repeated step_id from its memory of
        the last reply, without running it twice), with a fresh deadline. That is our outage, or the
        worker's (its heartbeat's bus_epoch moves: a cluster node it was on died, and its answer on
        the new connection is refused). No responders right after an outage (the worker has not
        resubscribed yet) is retried while the worker is in its grace."""
        subject, loop = subjects.worker_step(self.worker_id), asyncio.get_running_loop()
        deadline = loop.time() + self.step_timeout_s
        while True:
            outages = self._outages()
            reply = asyncio.ensure_future(self.nc.request(subject, payload, timeout=max(deadline - loop.time(), 0.01)))
            try:
                while not reply.done() and self._outages() == outages:
                    await asyncio.wait([reply], timeout=OUTAGE_POLL_S)
            finally:  # cancelled (the worker declared gone meanwhile): the request goes with us
                lost = not reply.done()
                if lost:
                    reply.cancel()
            if lost:  # the bus came back while we waited: the Step or its reply may be lost
                deadline = loop.time() + self.step_timeout_s
                continue
            try:
                return reply.result()
            except NoRespondersError:
                if not self.workers.in_grace(self.worker_id):
                    raise WorkerGone(f"worker {self.worker_id} is gone (no responders)") from None
                await asyncio.sleep(OUTAGE_POLL_S)
            except (TimeoutError, NatsTimeoutError):
                raise WorkerGone(f"worker {self.worker_id} missed its step deadline ({self.step_timeout_s}s)") from None

    def _outages(self) -> tuple[int, int]:
        """Our connection's reconnects and the worker's, as its heartbeat last said."""
        return self.nc.stats["reconnects"], self.worker_bus_epoch

    async def _fail_step(self, request_ids, error: str) -> None:
        log.error("step_error", worker_id=self.worker_id, error=error)
        for request_id in list(request_ids):
            request = self.scheduler.abort(request_id)
            if request is not None:
                await publish_error(self.nc, request, f"engine error: {error}")
        self.scheduler.take_dropped_ids()  # the worker already forgot them

    async def _fail_over(self, reason: str) -> list[str]:
        """Hand back every request the worker held, to be recomputed elsewhere (its stream goes on
        at the next offset), unless it has moved max_migrations times already. -> the ids of those
        whose move counted (they were on the worker)."""
        log.error("worker_gone", worker_id=self.worker_id, reason=reason)
        self.is_alive = False
        self.scheduler.kv.end_transfers(ok=False)  # a Step it may not have run: its tier copies are not trusted
        requeue, self._handoffs = self._handoffs, []  # off the worker already: they move freely
        counted = []
        for request in self.scheduler.take_all():
            # only a request the worker was computing may have brought it down: one that waited moves freely
            if request.is_on_worker and request.num_migrations >= self.max_migrations:
                await publish_error(self.nc, request, f"{reason}; the request already moved to another worker "
                                                      f"as often as --max-migrations ({self.max_migrations}) allows")
                continue
            if request.is_on_worker:
                counted.append(request.request_id)
            if request.is_on_worker or request.output_token_ids:
                request.migrate(counted=request.is_on_worker)
                log.info("request_migrating", request_id=request.request_id, worker_id=self.worker_id,
                         num_output_tokens=len(request.output_token_ids))
            requeue.append(request)
        await kv_publish.publish_cleared(self.nc, self.hello.model, self.worker_id)
        await self.on_gone(self, requeue)
        return counted

    async def fail_over(self, reason: str) -> list[str]:
        if self._task is not None:
            self._task.cancel()
        return await self._fail_over(reason)

    # ---- KV events ---------------------------------------------------------------------------

    async def _publish_kv_events(self) -> None:
        await kv_publish.publish_events(self.nc, self.hello.model, self.worker_id, self.scheduler.kv, self.tier)

    async def publish_snapshot(self) -> None:
        await kv_publish.publish_snapshot(self.nc, self.hello.model, self.worker_id, self.scheduler.kv, self.tier)
