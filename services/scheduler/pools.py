"""A model's worker pools: which are alive, where a request is, and where the requests of a worker
that is gone go (to another worker, or held until one comes back, for --worker-grace-s)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.scheduler.engine_metrics import EngineMetrics
from services.scheduler.host_tier import HostTiers
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.loras import ModelLoras
from services.scheduler.pool import PoolLoop
from services.scheduler.request import Request
from shared.log import get_logger
from shared.wire.images import ImageSpec
from shared.wire.lora import LoraInfo
from shared.wire.messages import EmbeddingSpec, ModelLimits, WorkerHello

log = get_logger("scheduler")


def worker_mismatch(peers: list[WorkerHello], hello: WorkerHello) -> str | None:
    """Each worker owns its KV geometry and max_model_len, and the scheduler takes them as they are
    announced; but a model's workers of one kind share prefix hashes (or static shapes) and one
    context limit, so a worker that disagrees with those of its kind already serving the model is
    refused. A paged worker gets a block manager, a slots worker a slot allocator; a model may have
    both (the router sends what fits the static shapes to the slots)."""
    for peer in [p for p in peers if p.kind == hello.kind]:
        for name in ("block_size", "kv_cache_dtype", "max_model_len"):
            if getattr(hello, name) != getattr(peer, name):
                return (f"{name} {getattr(hello, name)!r} != {getattr(peer, name)!r} of worker {peer.worker_id}, "
                        f"which already serves {hello.model!r}")
    return None


@dataclass
class RetiredCounts:
    """What the model's pools that are gone counted, so that its counters never go back when a
    worker dies (Prometheus would read a drop as a restart)."""

    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    steps_run: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    tier_queries: int = 0
    tier_hits: int = 0

    def absorb(self, pool: PoolLoop) -> None:
        self.metrics.add(pool.metrics)
        self.steps_run += pool.steps_run
        self.step_seconds += pool.step_seconds
        self.forward_seconds += pool.forward_seconds
        self.num_preemptions += pool.scheduler.num_preemptions
        self.prefix_cache_queries += pool.scheduler.kv.num_queried_tokens
        self.prefix_cache_hits += pool.scheduler.kv.num_hit_tokens
        self.tier_queries += pool.scheduler.kv.num_tier_queried_tokens
        self.tier_hits += pool.scheduler.kv.num_tier_hit_tokens


class WorkerPools:
    def __init__(self, loras: ModelLoras, grace_s: float, max_migrations: int = 2):
        """grace_s: how long a request whose worker is gone waits for one that can take it;
        max_migrations: --max-migrations, which also bounds how often a request's moves are given back."""
        self.loras = loras
        self.grace_s = grace_s
        self.max_migrations = max_migrations
        self._pools: dict[str, PoolLoop] = {}
        self.held: dict[str, tuple[Request, float]] = {}  # request id -> (request, monotonic deadline)
        self.retired = RetiredCounts()
        self.tiers = HostTiers()  # the host KV tiers the workers map, by id; they outlive any one worker
        # a worker declared gone for its silence -> (its process's instance, the requests whose move counted)
        self._silent: dict[str, tuple[str, list[str]]] = {}

    # ---- membership -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[PoolLoop]:
        return iter(list(self._pools.values()))

    def get(self, worker_id: str) -> PoolLoop | None:
        return self._pools.get(worker_id)

    def add(self, pool: PoolLoop) -> None:
        self._pools[pool.worker_id] = pool

    def remove(self, pool: PoolLoop) -> None:
        if self._pools.get(pool.worker_id) is pool:
            del self._pools[pool.worker_id]
            self.retired.absorb(pool)

    @property
    def alive(self) -> list[PoolLoop]:
        return [p for p in self._pools.values() if p.is_alive]

    def fell_silent(self, hello: WorkerHello, moved: list[str]) -> None:
        """A worker declared gone for its silence, with the requests whose move off it counted
        against --max-migrations: kept until the worker says hello again (forgive)."""
        if hello.instance:
            self._silent[hello.worker_id] = (hello.instance, moved)

    def forgive(self, hello: WorkerHello) -> None:
        """A worker back as the same process was paused or cut off from the bus, not brought down by
        a request: the moves its silence cost are given back to the requests still here. (A crash
        comes back as a new process, whose moves stay counted.) A request whose worker stalled as long
        as a pause, and not for a pause (Python holding the GIL for it), looks the same from here: so a
        request is forgiven at most --max-migrations times: such a request cannot move without end."""
        instance, moved = self._silent.pop(hello.worker_id, ("", []))
        if not instance or instance != hello.instance:
            return
        for request_id in moved:
            request = self.find(request_id)
            if request is None or not request.num_migrations:
                continue
            if request.num_forgiven >= self.max_migrations:
                log.warning("request_move_kept", request_id=request_id, worker_id=hello.worker_id,
                            reason=f"forgiven {request.num_forgiven} times already (--max-migrations)")
                continue
            request.num_migrations -= 1
            request.num_forgiven += 1
            log.info("request_move_forgiven", request_id=request_id, worker_id=hello.worker_id,
                     num_migrations=request.num_migrations)

    def mismatch(self, hello: WorkerHello) -> str | None:
        return worker_mismatch([p.hello for p in self.alive if p.worker_id != hello.worker_id], hello)

    # ---- requests -------------------------------------------------------------------------------

    def find(self, request_id: str) -> Request | None:
        held = self.held.get(request_id)
        return held[0] if held else next(
            (r for p in self._pools.values() if (r := p.scheduler.requests.get(request_id)) is not None), None)

    def requests(self) -> list[Request]:
        return [*(r for r, _ in self.held.values()),
                *(r for p in self._pools.values() for r in p.scheduler.requests.values())]

    def abort(self, request_id: str) -> tuple[Request | None, str]:
        """The request taken out of wherever it is: (it, the worker it was on, or "" if held)."""
        if (held := self.held.pop(request_id, None)) is not None:
            return held[0], ""
        for pool in self._pools.values():
            if (request := pool.abort(request_id)) is not None:
                return request, pool.worker_id
        return None, ""

    def fitting(self, request: Request) -> list[PoolLoop]:
        """The alive pools that can run it: its adapter served, its context and KV within reach."""
        total = request.num_prompt_tokens + request.sampling.max_tokens
        return [p for p in self.loras.pools_for(request.lora, self.alive) if p.can_take(total)]

    # ---- disaggregated prefill (kv_role) ----------------------------------------------------------

    @staticmethod
    def for_new_requests(pools: list[PoolLoop], request: Request) -> list[PoolLoop]:
        """New requests go to the prefill workers (and those of both roles) while one is alive; a
        decode worker takes them only when none is. An outside router's decode request (its
        kv_transfer_params' do_remote_prefill) goes to the decode workers while one is alive."""
        if request.held_for:
            return [p for p in pools if p.hello.kv_role != "kv_producer"] or pools
        if not any(p.hello.kv_role == "kv_producer" for p in pools):
            return pools
        return [p for p in pools if p.hello.kv_role != "kv_consumer"]

    def has_decoder(self) -> bool:
        return any(p.hello.kv_role != "kv_producer" for p in self.alive)

    def decoders(self, request: Request) -> list[PoolLoop]:
        """Where a prefill worker's request may go on: the decode workers (or those of both roles) that can take it."""
        return [p for p in self.fitting(request) if p.hello.kv_role != "kv_producer"]

    def place(self, requests: list[Request]) -> list[tuple[Request, PoolLoop | None]]:
        """Each request on the least loaded pool that can take it, or held for grace_s (None)."""
        placed = []
        for request in requests:
            fitting = self.fitting(request)
            if fitting:
                pool = min(fitting, key=lambda p: p.load)
                if request.lora is not None and not request.lora_digest:  # held since before any worker
                    request.lora_digest = self.loras.digest(request.lora, fitting)
                pool.add(request)
            else:
                pool = None
                self.hold(request)
            placed.append((request, pool))
        return placed

    def requeue(self, requests: list[Request]) -> int:
        """A gone worker's requests placed again (place): -> how many of them had run on it (migrations)."""
        for request, taker in self.place(requests):
            if taker is not None:
                log.info("request_migrated", request_id=request.request_id, worker_id=taker.worker_id)
            else:
                log.warning("request_held", request_id=request.request_id, grace_s=self.grace_s,
                            reason="no worker of the model can take it now")
        return sum(1 for r in requests if r.num_migrations)

    def take_all(self) -> list[Request]:
        """Every request, out of every pool and the held ones (a drain's end)."""
        return [r for p in self._pools.values() for r in p.scheduler.take_all()] + self.take_expired(float("inf"))

    def hold(self, request: Request) -> None:
        """No worker can take it yet: it waits grace_s for one (place_held), then fails."""
        self.held[request.request_id] = (request, time.monotonic() + self.grace_s)

    def place_held(self) -> list[tuple[Request, PoolLoop]]:
        """A worker came back: the held requests it can take go to it (or to the least loaded)."""
        waiting = [r for r, _ in self.held.values() if self.fitting(r)]
        for request in waiting:
            del self.held[request.request_id]
        return [(r, p) for r, p in self.place(waiting) if p is not None]

    def take_expired(self, now: float) -> list[Request]:
        expired = [r for r, deadline in self.held.values() if deadline < now]
        for request in expired:
            del self.held[request.request_id]
        return expired

    # ---- what the pools say together --------------------------------------------------------------

    @staticmethod
    def num_waiting_in(pools: list[PoolLoop]) -> int:
        return sum(len(p.scheduler.waiting) for p in pools)

    @staticmethod
    def prefix_cache(pools: list[PoolLoop]) -> KVCacheManager | None:
        """The first of `pools`' KV managers that caches prefixes (their hashes are the same), or None."""
        return next((p.scheduler.kv for p in pools if p.scheduler.kv.enable_prefix_caching), None)

    def limits(self, model: str, loras: list[LoraInfo]) -> ModelLimits:
        """The model's limits as its workers announced them (the API reads them from the scheduler)."""
        return ModelLimits(model=model, max_model_len=self.max_model_len if self.alive else 0, devices=self.devices,
                           architectures=self.architectures, embedding=self.embedding, images=self.images,
                           loras=loras)

    @property
    def load(self) -> int:
        return len(self.held) + sum(p.load for p in self.alive)

    @property
    def has_steps(self) -> bool:
        """A live worker has a Step coming: a request, or the ids of aborted ones it must forget."""
        return any(p.scheduler.has_work for p in self.alive)

    @property
    def num_running(self) -> int:
        return sum(len(p.scheduler.running) for p in self.alive)

    @property
    def num_waiting(self) -> int:
        return len(self.held) + sum(len(p.scheduler.waiting) for p in self.alive)

    @property
    def num_deferred(self) -> int:
        """Of the waiting, those kept by a passing constraint rather than the batch's capacity:
        held for a worker of the model, or an adapter's request without a LoRA slot."""
        return len(self.held) + sum(not p.scheduler.has_lora_slot(r) for p in self.alive for r in p.scheduler.waiting)

    @property
    def max_model_len(self) -> int:
        """The longest any of its workers takes (worker_mismatch keeps workers of one kind agreeing
        on it; slots workers may take less, and get only the requests that fit them)."""
        return max((p.hello.max_model_len for p in self._pools.values()), default=0)

    @property
    def vocab_size(self) -> int:
        """The narrowest vocabulary of the model's workers (0 while none has said)."""
        return min((p.hello.vocab_size for p in self._pools.values() if p.hello.vocab_size), default=0)

    @property
    def devices(self) -> list[str]:
        return sorted({p.hello.device for p in self.alive})

    @property
    def architectures(self) -> list[str]:
        return sorted({p.hello.architecture for p in self.alive if p.hello.architecture})

    @property
    def images(self) -> ImageSpec | None:
        return next((p.hello.images for p in self.alive if p.hello.images), None)

    @property
    def embedding(self) -> EmbeddingSpec | None:
        """The workers' (one model, one shape: the first alive worker's word)."""
        return next((p.hello.embedding for p in self.alive if p.hello.embedding), None)
