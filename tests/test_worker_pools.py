"""WorkerPools: where the requests of a worker that is gone go (the least loaded worker that can take
them, or held for --worker-grace-s), and what a worker that comes back takes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.scheduler.engine_metrics import EngineMetrics
from services.scheduler.loras import ModelLoras
from services.scheduler.pools import WorkerPools
from services.scheduler.request import Request
from shared.wire.lora import LoraInfo
from shared.wire.messages import BackendName, SamplingParams, WorkerHello, WorkerKind
from shared.wire.spec_decode import Drafts


@dataclass
class Hello:
    loras: list[LoraInfo] = field(default_factory=list)


@dataclass
class Counts:
    num_preemptions: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_tier_queried_tokens: int = 0
    num_tier_hit_tokens: int = 0

    @property
    def kv(self) -> Counts:
        return self

    def take_all(self) -> list[Request]:  # a drain takes the pool's requests out: none in these pools' schedulers
        return []


@dataclass
class Pool:
    """What WorkerPools reads of a PoolLoop: its id, liveness, load, adapters and what fits it, and
    the counters it keeps for the model's metrics."""

    worker_id: str
    max_tokens: int = 1000
    is_alive: bool = True
    hello: Hello = field(default_factory=Hello)
    added: list[str] = field(default_factory=list)
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    scheduler: Counts = field(default_factory=Counts)  # its num_preemptions, its kv's prefix counts
    steps_run: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0

    @property
    def load(self) -> int:
        return len(self.added)

    def can_take(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def add(self, request: Request) -> None:
        self.added.append(request.request_id)


def _request(request_id: str, num_prompt: int = 10, lora: str | None = None) -> Request:
    return Request(request_id, list(range(num_prompt)), SamplingParams(max_tokens=20), "reply", lora=lora)


def test_requests_go_to_the_least_loaded_worker_that_can_take_them():
    pools = WorkerPools(ModelLoras(), grace_s=60)
    busy, idle, small = Pool("busy", added=["x"]), Pool("idle"), Pool("small", max_tokens=30)
    for pool in (busy, idle, small):
        pools.add(pool)
    placed = pools.place([_request("a"), _request("b"), _request("long", num_prompt=100)])
    assert [(r.request_id, p.worker_id) for r, p in placed] == [("a", "idle"), ("b", "small"), ("long", "busy")]  # ties: the first
    assert pools.held == {}


def test_with_no_worker_they_are_held_then_taken_by_the_first_back_or_expire():
    pools = WorkerPools(ModelLoras(), grace_s=60)
    before = time.monotonic()
    placed = pools.place([_request("a"), _request("b", lora="sql")])
    assert [p for _, p in placed] == [None, None]
    assert set(pools.held) == {"a", "b"} and pools.num_waiting == 2 and pools.load == 2
    assert pools.find("a").request_id == "a"
    back = Pool("back")
    pools.add(back)
    taken = pools.place_held()
    assert [(r.request_id, p.worker_id) for r, p in taken] == [("a", "back")]  # b's adapter: not served there
    assert set(pools.held) == {"b"}
    deadline = pools.held["b"][1]
    assert before + 60 <= deadline <= time.monotonic() + 60
    assert pools.take_expired(deadline - 1) == []
    assert [r.request_id for r in pools.take_expired(deadline + 1)] == ["b"] and pools.held == {}


def test_a_gone_workers_requests_requeued_count_those_that_had_run_as_migrations():
    pools = WorkerPools(ModelLoras(), grace_s=60)
    pools.add(Pool("other", max_tokens=50))
    ran, queued, too_long = _request("ran"), _request("queued"), _request("long", num_prompt=100)
    ran.num_migrations = too_long.num_migrations = 1  # their worker had run them (PoolLoop counts it on failure)
    assert pools.requeue([ran, queued, too_long]) == 2
    assert pools.get("other").added == ["ran", "queued"] and set(pools.held) == {"long"}
    assert [r.request_id for r in pools.take_all()] == ["long"] and pools.held == {}  # a drain's end: held too


def test_a_worker_back_as_the_same_process_gives_back_the_moves_its_silence_cost():
    pools = WorkerPools(ModelLoras(), grace_s=60)
    paused, restarted = (WorkerHello(worker_id="w", model="m", backend=BackendName.TORCH_CPU, kind=WorkerKind.PAGED,
                                     num_blocks=16, block_size=16, max_batch=4, dtype="float32", max_model_len=256,
                                     instance=instance) for instance in ("first", "second"))
    moved = _request("moved")
    moved.num_migrations = 2
    pools.place([moved])  # held: no worker
    pools.fell_silent(paused, ["moved", "finished"])  # "finished" ended meanwhile: nothing to give back
    pools.forgive(restarted)  # a new process: it crashed (the request may be why), the move stays counted
    assert moved.num_migrations == 2
    pools.fell_silent(paused, ["moved"])
    pools.forgive(paused)  # the same process: paused or cut off
    assert moved.num_migrations == 1
    pools.forgive(paused)  # once per silence
    assert moved.num_migrations == 1


def test_a_request_is_forgiven_as_often_as_max_migrations_allows():
    """A worker stalled by a request (Python holding the GIL) comes back as the same process as a
    paused one does: forgiving such a request without end would let it stall workers without end."""
    pools = WorkerPools(ModelLoras(), grace_s=60, max_migrations=1)
    paused = WorkerHello(worker_id="w", model="m", backend=BackendName.TORCH_CPU, kind=WorkerKind.PAGED,
                         num_blocks=16, block_size=16, max_batch=4, dtype="float32", max_model_len=256,
                         instance="first")
    moved = _request("moved")
    pools.place([moved])
    for expected in (0, 1):
        moved.num_migrations += 1
        pools.fell_silent(paused, ["moved"])
        pools.forgive(paused)
        assert (moved.num_migrations, moved.num_forgiven) == (expected, 1)


def test_a_held_request_is_aborted_where_it_waits():
    pools = WorkerPools(ModelLoras(), grace_s=60)
    pools.place([_request("a")])
    request, worker_id = pools.abort("a")
    assert request.request_id == "a" and worker_id == "" and pools.held == {}
    assert pools.abort("a") == (None, "")


def test_a_dead_pool_takes_nothing():
    pools = WorkerPools(ModelLoras(), grace_s=60)
    dead = Pool("dead", is_alive=False)
    pools.add(dead)
    assert [p for _, p in pools.place([_request("a")])] == [None]
    pools.remove(dead)
    assert list(pools) == []


def test_a_removed_pools_counts_live_on_in_the_models():
    """The model's counters (steps, preemptions, prefix-cache lookups, the histograms and the
    spec_decode counters) sum the pools there are and those that are gone: they never go back."""
    pools = WorkerPools(ModelLoras(), grace_s=60)
    first, second = Pool("w1", steps_run=5, scheduler=Counts(2, 100, 40)), Pool("w2", steps_run=7)
    first.metrics.iteration_tokens.observe(3)
    first.metrics.spec_decode.observe([Drafts("a", 4, 2)])
    pools.add(first)
    pools.add(second)
    pools.remove(first)
    pools.remove(first)  # a second removal of the same pool counts nothing twice
    gone = pools.retired
    assert (gone.steps_run, gone.num_preemptions, gone.prefix_cache_queries, gone.prefix_cache_hits) == (5, 2, 100, 40)
    assert gone.metrics.iteration_tokens.count == 1 and gone.metrics.spec_decode.num_accepted_tokens == 2
