"""The scheduler on the bus: admission (Submit -> Accepted | Rejected), aborts, worker discovery."""

from __future__ import annotations

import asyncio
import time

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.scheduler.kv_holds import KvHolds, kv_transfer_error
from services.scheduler.lease import Lease
from services.scheduler.loras import ModelLoras
from services.scheduler.pool import PoolLoop
from services.scheduler.pools import WorkerPools
from services.scheduler.reply import publish_error
from services.scheduler.request import Request
from services.scheduler.router import Router
from services.scheduler.sleep_mode import ModelSleep
from services.scheduler.stats import scheduler_stats, settle
from services.scheduler.tier_fetch import fetch_remote_prefix
from services.scheduler.validate import images_error, submit_error
from shared.bus.endpoints import Endpoints
from shared.bus.liveness import CLIENT_SILENCE_S, WORKER_SILENCE_S, BusProbe, Heartbeats
from shared.config import EngineConfig, context_length_error
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.hashing import max_cacheable_blocks
from shared.wire.kv_events import KV_HELD_QUERY_DECODER
from shared.wire.lora import LORA_ORDER_DECODER, LoraInfo
from shared.wire.messages import (
    ABORT_DECODER,
    CLIENT_HEARTBEAT_DECODER,
    SUBMIT_DECODER,
    WORKER_ANNOUNCE_DECODER,
    Accepted,
    Discover,
    FinishReason,
    RejectCode,
    Rejected,
    Submit,
    WorkerHeartbeat,
    WorkerHello,
    encode,
)
from shared.wire.sleep import SLEEP_ORDER_DECODER
from shared.wire.stats import SchedulerStatsRequest

log = get_logger("scheduler")
WATCH_INTERVAL_S = 0.25  # how often silent workers and clients, and passed deadlines, are looked for


class SchedulerService:
    def __init__(self, nc: Client, config: EngineConfig, scheduler_id: str = ""):
        """scheduler_id: the process's (SchedulerHost's), whose heartbeats tell bus clients it is alive."""
        self.nc = nc
        self.scheduler_id = scheduler_id
        self.lease: Lease | None = None  # the host's once it leads: its token on Steps, its key in Accepteds
        self.config = config
        self.model = config.model
        self.loras = ModelLoras()
        self.pools = WorkerPools(self.loras, config.worker_grace_s, config.max_migrations)
        self.router = Router(nc, config.model)
        self.holds = KvHolds()  # prefill requests' blocks an outside router's decode requests will load
        self._routing: dict[str, Request] = {}  # accepted, not yet in a pool (the KV lookup is in flight)
        self._aborted_while_routing: set[str] = set()
        self._refused_workers: set[str] = set()
        self.workers = Heartbeats(nc, WORKER_SILENCE_S, probe=BusProbe.of(nc))  # a paused bus: no one's death
        self.clients = Heartbeats(nc, CLIENT_SILENCE_S, probe=BusProbe.of(nc))  # those with requests here
        self.endpoints = Endpoints(nc, "scheduler", f"{config.model}-{scheduler_id or 'local'}")
        self._watchdog: asyncio.Task | None = None
        self.is_draining = False
        self.sleep = ModelSleep(config.model, config.step_timeout_s)  # the pools parked, their workers' memory freed
        self.num_deadline_exceeded = 0
        self.num_migrations = 0  # requests moved off a dead worker
        self.num_admission_rejections = 0  # Submits refused for a full queue

    async def start(self) -> None:
        add = self.endpoints.add
        await add("submit", subjects.submit(self.model), self._on_submit, queue=f"scheduler.{subjects.token(self.model)}")
        await add("abort", subjects.abort(self.model), self._on_abort)
        await add("hello", subjects.WORKERS_HELLO, self._on_announce)
        await add("worker_heartbeat", subjects.WORKERS_HEARTBEAT, self._on_announce)
        await add("resync", subjects.KV_RESYNC, self._on_resync)
        await add("client_heartbeat", subjects.CLIENTS_HEARTBEAT, self._on_client_heartbeat)
        await add("stats", subjects.scheduler_stats(self.model), self._on_stats)
        await add("sleep", subjects.sleep(self.model), self._on_sleep)
        await add("lora", subjects.lora(self.model), self._on_lora)
        await add("kv_held", subjects.kv_held(self.model), self._on_kv_held)
        await self.endpoints.start()
        await self.nc.publish(subjects.WORKERS_DISCOVER, encode(Discover(model=self.model)))
        self.workers.probe.start()
        self._watchdog = asyncio.create_task(self._watch())
        log.info("scheduler_ready", model=self.model)

    async def stop(self) -> None:
        if self._watchdog:
            self._watchdog.cancel()
        await self.endpoints.stop()
        for pool in self.pools:
            await pool.stop()

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: take no new request, let the admitted ones finish (and the workers hear which were
        aborted: else each waits out its own drain for them), fail what is left at the end."""
        self.is_draining = True
        log.info("scheduler_draining", model=self.model, num_requests=self.num_requests, grace_s=grace_s)
        deadline = time.monotonic() + grace_s
        while (self.num_requests or self.pools.has_steps) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request in self.pools.take_all():
            await publish_error(self.nc, request, "the server shut down before the request finished")

    @property
    def num_requests(self) -> int:
        return len(self._routing) + self.pools.load

    # ---- admission -----------------------------------------------------------------------------

    async def _on_submit(self, msg: Msg) -> None:
        received_at = time.time()
        try:
            submit = SUBMIT_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            await msg.respond(encode(Rejected(request_id="", code=RejectCode.INVALID, reason=f"bad Submit: {exc}")))
            return
        reply = self.admit(submit)
        if isinstance(reply, Accepted):
            reply.received_at, reply.scheduler_id = received_at, self.scheduler_id
            reply.lease = self.lease.key if self.lease is not None else ""
        await msg.respond(encode(reply))

    def admit(self, submit: Submit) -> Accepted | Rejected:
        def reject(code: RejectCode, reason: str) -> Rejected:
            log.info("request_rejected", request_id=submit.request_id, reason=reason)
            return Rejected(request_id=submit.request_id, code=code, reason=reason)

        pools = self.pools.alive
        if submit.model != self.model:
            return reject(RejectCode.INVALID, f"this scheduler serves {self.model!r}, not {submit.model!r}")
        if self.is_draining:
            return reject(RejectCode.UNAVAILABLE, "the scheduler is shutting down")
        if not pools and submit.resumed:
            return self._hold_resumed(submit)
        if not pools:
            return reject(RejectCode.UNAVAILABLE, f"no worker is ready for model {self.model!r}")
        if (invalid := submit_error(submit, self.pools.vocab_size)
                or images_error(submit, self.pools.images, self.config.max_num_batched_tokens)
                or kv_transfer_error(submit.kv_transfer, [p.tier for p in pools])) is not None:
            return reject(RejectCode.INVALID, invalid)
        if submit.request_id in self._routing or self.pools.find(submit.request_id) is not None:
            return reject(RejectCode.IN_FLIGHT, f"request_id {submit.request_id!r} is already in flight")
        num_prompt, max_tokens = len(submit.prompt_token_ids), submit.sampling.max_tokens
        if submit.resume_token_ids:
            log.info("request_resumed", request_id=submit.request_id, num_output_tokens=len(submit.resume_token_ids))
        too_long = context_length_error(self.pools.max_model_len, num_prompt, max_tokens)
        if too_long:
            return reject(RejectCode.INVALID, too_long)
        num_running = self.pools.num_running
        num_waiting = self.num_requests - num_running
        if self.num_requests >= self.config.max_concurrent_batch_size + self.config.max_waiting:
            self.num_admission_rejections += 1
            return reject(RejectCode.QUEUE_FULL, f"the queue for {self.model!r} is full "
                          f"({num_running} running, {num_waiting} waiting)")
        if submit.lora is not None and not (pools := self.loras.pools_for(submit.lora, pools)):
            return reject(RejectCode.NOT_FOUND, f"The model `{submit.lora}` does not exist.")
        total = num_prompt + max_tokens
        pools = [p for p in pools if p.can_take(total)]
        if not pools:
            return reject(RejectCode.INVALID, f"{total} tokens can never fit in the KV cache")
        request = Request.from_submit(submit)
        if request.lora is not None:
            request.lora_digest = self.loras.digest(request.lora, pools)
        if request.client_id:
            self.clients.heard(request.client_id)
        self._routing[request.request_id] = request
        asyncio.get_running_loop().create_task(self._route(request, pools))
        return Accepted(request_id=submit.request_id, num_waiting=self.pools.num_waiting_in(pools))

    def _hold_resumed(self, submit: Submit) -> Accepted | Rejected:
        """A request another leader accepted, taken over before this one's workers have said hello
        (they answer its Discover within a heartbeat, later on a loaded host): held for
        --worker-grace-s as a dead worker's requests are, not refused. Its lost leader checked it."""
        if submit.request_id in self._routing or self.pools.find(submit.request_id) is not None:
            return Rejected(request_id=submit.request_id, code=RejectCode.IN_FLIGHT,
                            reason=f"request_id {submit.request_id!r} is already in flight")
        log.info("request_held", request_id=submit.request_id, grace_s=self.config.worker_grace_s,
                 reason=f"resumed before any worker of {self.model!r} said hello")
        request = Request.from_submit(submit)
        if request.client_id:
            self.clients.heard(request.client_id)
        self.pools.hold(request)
        return Accepted(request_id=submit.request_id)

    async def _route(self, request: Request, pools: list[PoolLoop]) -> None:
        lookup: list[bytes] = []
        kv0 = self.pools.prefix_cache(pools)
        if self.config.enable_prefix_caching and kv0 is not None:
            kv0.update_block_hashes(request)
            lookup = request.block_hashes[:max_cacheable_blocks(request.num_tokens, kv0.block_size)]
        pools = self.pools.for_new_requests([p for p in pools if p.is_alive] or pools, request)
        self.holds.missing(request, self.pools.tiers)
        pool = await self.router.choose(pools, lookup, request.lora)
        await fetch_remote_prefix(self.nc, pool, request)  # what only another host's tier holds
        self._routing.pop(request.request_id, None)
        if request.request_id in self._aborted_while_routing:
            self._aborted_while_routing.discard(request.request_id)
            return
        if not pool.is_alive:  # its worker was declared gone while the lookup was out
            self.pools.place([request])
            return
        log.info("request_routed", request_id=request.request_id, worker_id=pool.worker_id)
        pool.add(request)

    def can_run_more(self) -> bool:
        """max_concurrent_batch_size caps the requests running at once for the model, over all pools."""
        return self.pools.num_running < self.config.max_concurrent_batch_size

    async def _on_abort(self, msg: Msg) -> None:
        """An Abort ends the requests whose Submit carried its abort_key; each gets its final entry."""
        abort = ABORT_DECODER.decode(msg.data)
        for request_id in abort.request_ids:
            request = self._find(request_id)
            if request is None:
                continue
            if request.abort_key != abort.abort_key:
                log.warning("abort_refused", request_id=request_id, reason="the abort_key is not the submitter's")
                continue
            if self._abort(request_id) is not None:
                await publish_error(self.nc, request, None, FinishReason.ABORT)

    def _find(self, request_id: str) -> Request | None:
        return self._routing.get(request_id) or self.pools.find(request_id)

    def _abort(self, request_id: str) -> Request | None:
        if (request := self._routing.get(request_id)) is not None:
            self._aborted_while_routing.add(request_id)
            return request
        request, worker_id = self.pools.abort(request_id)
        if request is not None:
            log.info("request_aborted", request_id=request_id, worker_id=worker_id)
            self.holds.release(request.held_for)  # a decode request that will not load its prefill's blocks
        return request

    async def _on_client_heartbeat(self, msg: Msg) -> None:
        client_id = CLIENT_HEARTBEAT_DECODER.decode(msg.data).client_id
        if client_id in self.clients:
            self.clients.heard(client_id)

    async def _abort_client(self, client_id: str) -> None:
        """A client that stopped heartbeating (a dead gateway) wants none of its requests any more. Each
        still gets its final entry: a client that was only slow learns its streams ended, never waits."""
        self.clients.forget(client_id)
        pending = [r for r in self.in_flight if r.client_id == client_id]
        for request in pending:
            self._abort(request.request_id)
        log.warning("client_gone", client_id=client_id, num_aborted=len(pending))
        for request in pending:
            await publish_error(self.nc, request, f"the scheduler heard no heartbeat from this client for "
                                                  f"{CLIENT_SILENCE_S:g}s and ended its requests")

    # ---- workers -------------------------------------------------------------------------------

    async def _on_announce(self, msg: Msg) -> None:
        announce = WORKER_ANNOUNCE_DECODER.decode(msg.data)
        if announce.model != self.model or announce.worker_id in self._refused_workers:
            return
        if isinstance(announce, WorkerHello) and (mismatch := self.pools.mismatch(announce)):
            self._refused_workers.add(announce.worker_id)
            log.error("worker_refused", worker_id=announce.worker_id, reason=mismatch)
            return
        pool = self.pools.get(announce.worker_id)
        restarted = isinstance(announce, WorkerHello) and pool is not None and announce.instance != pool.hello.instance
        if restarted and pool.is_alive:  # a new process under its id, back within the silence window
            await pool.fail_over(f"worker {announce.worker_id} restarted (a new process): what it held is gone")
            pool = None
        if pool is not None and pool.is_alive:
            self.workers.heard(announce.worker_id)
            if isinstance(announce, WorkerHeartbeat):
                pool.worker_bus_epoch = announce.bus_epoch
            if isinstance(announce, WorkerHello) and (announce.device, announce.loras) != (pool.hello.device,
                                                                                             pool.hello.loras):
                pool.hello.device, pool.hello.loras = announce.device, announce.loras  # compiled now; adapters
                await self.publish_limits()
        elif isinstance(announce, WorkerHello):
            self._add_pool(announce)
        elif isinstance(announce, WorkerHeartbeat):
            await self.nc.publish(subjects.WORKERS_DISCOVER, encode(Discover(model=self.model)))

    def _add_pool(self, hello: WorkerHello) -> None:
        pool = PoolLoop(self.nc, hello, self.config, on_gone=self._on_pool_gone, can_run_more=self.can_run_more,
                        workers=self.workers, lease=self.lease, tier=self.pools.tiers.get(hello.kv_tier),
                        on_handoff=self._on_handoff, has_decoder=self.pools.has_decoder, holds=self.holds)
        self.pools.add(pool)
        self.pools.forgive(hello)
        pool.start()
        self.sleep.joined(pool)
        log.info("worker_joined", worker_id=hello.worker_id, backend=hello.backend.label, device=hello.device,
                 num_blocks=hello.num_blocks)
        for request, taker in self.pools.place_held():  # they waited for a worker: this one, or one less loaded
            log.info("request_migrated", request_id=request.request_id, worker_id=taker.worker_id, held=True)
        asyncio.get_running_loop().create_task(self.publish_limits())

    async def publish_limits(self) -> None:
        """The model's max_model_len as its workers announced it (the API reads it from here)."""
        await self.nc.publish(subjects.MODEL_LIMITS, encode(self.pools.limits(self.model, self.served_loras)))

    async def _on_handoff(self, pool: PoolLoop, requests: list[Request]) -> None:
        """A prefill worker's requests at their first token go on on a decode worker (by the prefix
        it reaches, then load), their prompts' blocks loaded from the host tier."""
        for request in requests:
            decoders = self.pools.decoders(request)
            if not decoders:  # the decode workers went meanwhile: any worker that can take it
                self.pools.place([request])
                continue
            decoder = await self.router.choose(decoders, request.block_hashes, request.lora)
            await fetch_remote_prefix(self.nc, decoder, request)  # a prefill worker on another host
            decoder.add(request)

    async def _on_pool_gone(self, pool: PoolLoop, requeue: list[Request]) -> None:
        """Its requests go to the least loaded worker that can take them, or wait for one (the
        model's every worker paused, or restarting) for --worker-grace-s."""
        self.pools.remove(pool)
        self.workers.forget(pool.worker_id)
        await self.publish_limits()
        self.num_migrations += self.pools.requeue(requeue)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            wall = time.time()
            for client_id in self.clients.silent():
                await self._abort_client(client_id)
            silent = set(self.workers.silent())
            for pool in self.pools:
                if pool.is_alive and pool.worker_id in silent:
                    moved = await pool.fail_over(f"worker {pool.worker_id} stopped sending heartbeats")
                    self.pools.fell_silent(pool.hello, moved)  # given back if the same process comes back
            for request in [r for r in self.pools.requests() if r.is_past_deadline(wall)]:
                self._abort(request.request_id)
                self.num_deadline_exceeded += 1
                log.info("request_deadline_exceeded", request_id=request.request_id)
                await publish_error(self.nc, request, "the request ran past its deadline and was stopped",
                                    FinishReason.TIMEOUT)
            for request in self.pools.take_expired(time.monotonic()):
                log.warning("request_failed", request_id=request.request_id, error="no worker came back")
                await publish_error(self.nc, request, f"no worker of {self.model!r} could take the request for "
                                                      f"{self.config.worker_grace_s:g}s (--worker-grace-s); retry it")
            self.holds.expire(time.monotonic())
            if self.loras.unloading and await self.loras.release_idle(self.pools.alive, self.in_flight):
                await self.publish_limits()

    # ---- stats and resync ----------------------------------------------------------------------

    async def _on_resync(self, msg: Msg) -> None:
        for pool in self.pools:
            await pool.publish_snapshot()
        if msg.reply:
            await msg.respond(b"")

    async def _on_stats(self, msg: Msg) -> None:
        try:
            settled = msgspec.msgpack.decode(msg.data, type=SchedulerStatsRequest).settled
        except msgspec.DecodeError:
            settled = False
        if settled:
            await settle(list(self.pools))
        await msg.respond(encode(scheduler_stats(
            self.model, self.pools, self.config, is_draining=self.is_draining,
            num_deadline_exceeded=self.num_deadline_exceeded, num_migrations=self.num_migrations,
            num_admission_rejections=self.num_admission_rejections,
            is_sleeping=self.sleep.is_sleeping, sleep_level=self.sleep.level, loras=self.served_loras)))

    @property
    def in_flight(self) -> list[Request]:
        return [*self._routing.values(), *self.pools.requests()]

    @property
    def served_loras(self) -> list[LoraInfo]:
        return self.loras.served(self.pools.alive)

    async def _on_lora(self, msg: Msg) -> None:
        """Load or unload a LoRA adapter on every worker of the model (loras.py)."""
        state = await self.loras.order(LORA_ORDER_DECODER.decode(msg.data), self.pools.alive)
        await self.publish_limits()
        await msg.respond(encode(state))

    async def _on_kv_held(self, msg: Msg) -> None:
        """Where a do_remote_decode request's prompt blocks wait (the gateway's kv_transfer_params)."""
        query = KV_HELD_QUERY_DECODER.decode(msg.data)
        await msg.respond(encode(await self.holds.answer(query.request_id, self.config.step_timeout_s)))

    async def _on_sleep(self, msg: Msg) -> None:
        """Sleep or WakeUp for every pool of the model (sleep_mode.py)."""
        await msg.respond(encode(await self.sleep.order(SLEEP_ORDER_DECODER.decode(msg.data), self.pools.alive)))
