"""A model's SchedulerStats, summed over its pools, counters over those gone too (the API's /metrics and /health read them)."""

from __future__ import annotations

import asyncio

from services.scheduler.pool import PoolLoop
from services.scheduler.pools import WorkerPools
from shared.config import EngineConfig
from shared.wire.histogram import HistogramCounts
from shared.wire.lora import LoraInfo
from shared.wire.spec_decode import SpecDecodeCounts
from shared.wire.stats import ITERATION_TOKEN_BUCKETS, REQUEST_NUM_PREEMPTIONS_BUCKETS, SchedulerStats

STATS_SETTLE_S = 1.0  # a settled stats request waits this long at most for the Steps out


async def settle(pools: list[PoolLoop]) -> None:
    """Wait a little for the Steps out to come back: a metrics scrape right after a response then
    counts the Step that made its last token, as vLLM's does."""
    waits = [asyncio.ensure_future(p.between_steps.wait()) for p in pools]
    if waits:
        await asyncio.wait(waits, timeout=STATS_SETTLE_S)
        for wait in waits:
            wait.cancel()


def scheduler_stats(model: str, pools: WorkerPools, config: EngineConfig, *, is_draining: bool,
                    num_deadline_exceeded: int, num_admission_rejections: int, num_migrations: int, is_sleeping: bool, sleep_level: int,
                    loras: list[LoraInfo]) -> SchedulerStats:
    alive, every, gone = pools.alive, list(pools), pools.retired  # counters: every pool there was
    kvs = [p.scheduler.kv for p in alive]
    return SchedulerStats(
        model=model, num_workers=len(alive), num_running=pools.num_running, num_waiting=pools.num_waiting,
        kv_cache_usage=sum(kv.usage for kv in kvs) / len(kvs) if kvs else 0.0,
        num_preemptions=gone.num_preemptions + sum(p.scheduler.num_preemptions for p in every),
        prefix_cache_queries=gone.prefix_cache_queries + sum(p.scheduler.kv.num_queried_tokens for p in every),
        prefix_cache_hits=gone.prefix_cache_hits + sum(p.scheduler.kv.num_hit_tokens for p in every),
        external_prefix_cache_queries=gone.tier_queries + sum(p.scheduler.kv.num_tier_queried_tokens for p in every),
        external_prefix_cache_hits=gone.tier_hits + sum(p.scheduler.kv.num_tier_hit_tokens for p in every),
        max_model_len=pools.max_model_len if alive else 0,
        steps_run=gone.steps_run + sum(p.steps_run for p in every),
        step_seconds=gone.step_seconds + sum(p.step_seconds for p in every),
        forward_seconds=gone.forward_seconds + sum(p.forward_seconds for p in every),
        is_draining=is_draining, num_deadline_exceeded=num_deadline_exceeded,
        block_size=alive[0].hello.block_size if alive else 0,
        kv_cache_dtype=alive[0].hello.kv_cache_dtype if alive else "",
        num_blocks=sum(p.hello.num_blocks for p in alive), enable_prefix_caching=config.enable_prefix_caching,
        iteration_tokens=HistogramCounts.total([p.metrics.iteration_tokens for p in [*every, gone]],
                                               ITERATION_TOKEN_BUCKETS),
        request_num_preemptions=HistogramCounts.total([p.metrics.request_num_preemptions for p in [*every, gone]],
                                                      REQUEST_NUM_PREEMPTIONS_BUCKETS),
        num_waiting_deferred=pools.num_deferred, num_admission_rejections=num_admission_rejections,
        devices=pools.devices, architectures=pools.architectures, embedding=pools.embedding, images=pools.images,
        num_migrations=num_migrations, is_sleeping=is_sleeping, sleep_level=sleep_level, loras=loras,
        max_loras=max((p.hello.max_loras for p in alive), default=0),
        running_loras=sorted({r.lora for p in alive for r in p.scheduler.running if r.lora}),
        waiting_loras=sorted({r.lora for p in alive for r in p.scheduler.waiting if r.lora}),
        spec_decode=_spec_decode([*every, gone]) if any(p.hello.num_speculative_tokens for p in every)
        or gone.metrics.spec_decode.num_drafts else None,
    )


def _spec_decode(pools) -> SpecDecodeCounts:
    total = SpecDecodeCounts()
    for pool in pools:
        total.add(pool.metrics.spec_decode)
    return total
