"""Prometheus metrics: vLLM's names where one exists, switchyard_* for the bus and each service.

Request-level histograms and counters are observed here, at the gateway, as requests finish.
Engine state (running/waiting requests, KV usage, prefix-cache and preemption counters, step
times) lives in the schedulers and the KV index; it is fetched over the bus at scrape time.
With several gateway processes (processes.py) each writes its series to PROMETHEUS_MULTIPROC_DIR,
and a scrape of any of them sums them all.
"""

from __future__ import annotations

import asyncio
import os

from nats.aio.client import Client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from shared import subjects
from shared.messages import (
    KV_STATS_REPLY_DECODER,
    SCHEDULER_STATS_DECODER,
    KvStatsRequest,
    SchedulerStats,
    SchedulerStatsRequest,
    encode,
)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
SCRAPE_TIMEOUT_S = 0.5
disable_created_metrics()  # no *_created series: vLLM's dashboards do not expect them


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", m,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduled.",
                                    m, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       [*m, "finished_reason"], registry=r)
        self.in_flight = Gauge("switchyard_api_requests_in_flight", "Requests the gateway is serving.",
                               registry=r, multiprocess_mode="livesum")
        self.http_errors = Counter("switchyard_api_errors", "Error answers by HTTP status.", ["status"],
                                   registry=r)

    def exposition(self) -> bytes:
        """The gateway's own series, summed over every gateway process when there are several."""
        multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not multiproc_dir:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, multiproc_dir)
        return generate_latest(registry)

    def observe_finished(self, model: str, *, ttft: float | None, e2e: float, queue_time: float | None,
                         num_prompt_tokens: int, num_output_tokens: int, finish_reason: str) -> None:
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        if queue_time is not None:
            self.queue_time.labels(model).observe(max(queue_time, 0.0))
        self.e2e.labels(model).observe(e2e)
        self.prompt_tokens.labels(model).inc(num_prompt_tokens)
        self.generation_tokens.labels(model).inc(num_output_tokens)
        self.request_success.labels(model, finish_reason).inc()

    async def collect_engine(self, nc: Client, models: list[str]) -> list:
        """The engine's metric families, asked of the schedulers and the KV index over the bus."""
        replies = await asyncio.gather(*(_ask_stats(nc, m) for m in models))
        stats = {m: s for m, s in zip(models, replies, strict=True) if s is not None}
        return engine_families(stats) + await _kv_families(nc) + [_nats_family(nc)]


async def _ask_stats(nc: Client, model: str) -> SchedulerStats | None:
    try:
        msg = await nc.request(subjects.scheduler_stats(model), encode(SchedulerStatsRequest()),
                               timeout=SCRAPE_TIMEOUT_S)
        return SCHEDULER_STATS_DECODER.decode(msg.data)
    except Exception:  # a scheduler that does not answer is simply absent from this scrape
        return None


# (family, name, help, SchedulerStats field): the engine's state, one series per model
_ENGINE_SERIES = [
    (GaugeMetricFamily, "vllm:num_requests_running", "Requests running on the workers.", "num_running"),
    (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", "kv_cache_usage"),
    (GaugeMetricFamily, "switchyard_scheduler_workers", "Workers serving the model.", "num_workers"),
    (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    (CounterMetricFamily, "vllm:num_preemptions", "Preemptions.", "num_preemptions"),
    (CounterMetricFamily, "switchyard_scheduler_steps", "Model steps run.", "num_steps"),
    (CounterMetricFamily, "switchyard_scheduler_step_seconds", "Step round trips, summed.", "step_seconds"),
    (CounterMetricFamily, "switchyard_worker_forward_seconds", "Time workers spent in steps.", "forward_seconds"),
    (CounterMetricFamily, "switchyard_scheduler_deadline_exceeded", "Requests ended by their deadline.",
     "num_deadline_exceeded"),
]


def engine_families(stats: dict[str, SchedulerStats]) -> list:
    families = []
    for family_cls, name, doc, field in _ENGINE_SERIES:
        family = family_cls(name, doc, labels=["model_name"])
        for model, s in stats.items():
            family.add_metric([model], getattr(s, field))
        families.append(family)
    return families


async def _kv_families(nc: Client) -> list:
    blocks = GaugeMetricFamily("switchyard_kvcache_blocks", "Cached blocks the KV index knows, per pool.",
                               labels=["pool", "model_name"])
    try:
        msg = await nc.request(subjects.KV_STATS, encode(KvStatsRequest()), timeout=SCRAPE_TIMEOUT_S)
    except Exception:
        return [blocks]
    reply = KV_STATS_REPLY_DECODER.decode(msg.data)
    for pool, num in reply.num_blocks_by_pool.items():
        blocks.add_metric([pool, reply.model_by_pool.get(pool, "")], num)
    return [blocks]


def _nats_family(nc: Client) -> CounterMetricFamily:
    """The answering process's own connection (pid: one series per gateway process)."""
    family = CounterMetricFamily("switchyard_nats", "The gateway's NATS connection.", labels=["stat", "pid"])
    for stat in ("in_msgs", "out_msgs", "in_bytes", "out_bytes", "reconnects", "errors_received"):
        family.add_metric([stat, str(os.getpid())], nc.stats.get(stat, 0))
    return family
