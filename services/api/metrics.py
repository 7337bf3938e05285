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
import time

from nats.aio.client import Client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from shared.wire import subjects
from shared.wire.histogram import HistogramCounts
from shared.wire.kv_events import KV_STATS_REPLY_DECODER, KvStatsRequest
from shared.wire.messages import encode
from shared.wire.stats import SCHEDULER_STATS_DECODER, SchedulerStats, SchedulerStatsRequest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
SCRAPE_TIMEOUT_S = 1.5  # the scheduler waits up to 1 s (STATS_SETTLE_S) for the Steps out
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
        tokens = _token_buckets()
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens of a request.", m,
                                               buckets=tokens, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Tokens a request generated.",
                                                   m, buckets=tokens, registry=r)
        self.request_params_n = Histogram("vllm:request_params_n", "The n of a request.", m,
                                          buckets=(1, 2, 5, 10, 20), registry=r)
        self.request_params_max_tokens = Histogram("vllm:request_params_max_tokens", "The max_tokens of a request.",
                                                   m, buckets=tokens, registry=r)
        self.inference_time = Histogram("vllm:request_inference_time_seconds", "From first scheduled to finished.",
                                        m, buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "From first scheduled to first token.",
                                      m, buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "From first token to finished.",
                                     m, buckets=_LATENCY_BUCKETS, registry=r)
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

    def observe_params(self, model: str, n: int, max_tokens: int) -> None:
        self.request_params_n.labels(model).observe(n)
        self.request_params_max_tokens.labels(model).observe(max_tokens)

    def observe_phases(self, model: str, scheduled_at: float, first_token_at: float, finished_at: float) -> None:
        """Wall-clock times from the engine (the scheduler's and the worker's clocks)."""
        self.inference_time.labels(model).observe(max(finished_at - scheduled_at, 0.0))
        self.prefill_time.labels(model).observe(max(first_token_at - scheduled_at, 0.0))
        self.decode_time.labels(model).observe(max(finished_at - first_token_at, 0.0))

    def observe_finished(self, model: str, *, ttft: float | None, e2e: float, queue_time: float | None,
                         num_prompt_tokens: int, num_output_tokens: int, finish_reason: str) -> None:
        self.request_prompt_tokens.labels(model).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(model).observe(num_output_tokens)
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
        msg = await nc.request(subjects.scheduler_stats(model), encode(SchedulerStatsRequest(settled=True)),
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
    (CounterMetricFamily, "vllm:external_prefix_cache_queries", "Prompt tokens looked up in the host KV tier.",
     "external_prefix_cache_queries"),
    (CounterMetricFamily, "vllm:external_prefix_cache_hits", "Prompt tokens loaded from the host KV tier.",
     "external_prefix_cache_hits"),
    (CounterMetricFamily, "vllm:num_preemptions", "Preemptions.", "num_preemptions"),
    (CounterMetricFamily, "switchyard_scheduler_steps", "Model steps run.", "steps_run"),
    (CounterMetricFamily, "switchyard_scheduler_step_seconds", "Step round trips, summed.", "step_seconds"),
    (CounterMetricFamily, "switchyard_worker_forward_seconds", "Time workers spent in steps.", "forward_seconds"),
    (CounterMetricFamily, "switchyard_scheduler_deadline_exceeded", "Requests ended by their deadline.",
     "num_deadline_exceeded"),
    (CounterMetricFamily, "switchyard_scheduler_migrations", "Requests moved off a worker that died.",
     "num_migrations"),
]


def engine_families(stats: dict[str, SchedulerStats]) -> list:
    families = []
    for family_cls, name, doc, field in _ENGINE_SERIES:
        family = family_cls(name, doc, labels=["model_name"])
        for model, s in stats.items():
            family.add_metric([model], getattr(s, field))
        families.append(family)
    sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Sleep mode: 1 on the state the engine is in.",
                              labels=["model_name", "sleep_state"])
    for model, s in stats.items():  # vLLM's states: awake, level 1 (weights offloaded), level 2 (discarded)
        for state, level in (("awake", 0), ("weights_offloaded", 1), ("discard_all", 2)):
            sleep.add_metric([model, state], float(s.sleep_level == level))
    families.append(sleep)
    cache = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration.",
                              labels=["model_name", "block_size", "cache_dtype", "num_gpu_blocks", "enable_prefix_caching",
                                      "kv_cache_size_tokens", "kv_cache_max_concurrency"])
    iteration = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens per model iteration.",
                                      labels=["model_name"])
    preemptions = HistogramMetricFamily("vllm:request_num_preemptions", "Preemptions of each finished request.",
                                        labels=["model_name"])
    waiting = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                                "Waiting requests by reason: capacity (the batch is full) or deferred (held by a "
                                "passing constraint: no worker of the model, a LoRA slot).",
                                labels=["model_name", "reason"])
    rejected = CounterMetricFamily("vllm:admission_rejections", "Requests refused by a queue limit, by reason.",
                                   labels=["model_name", "reason"])
    for model, s in stats.items():
        if s.num_workers:
            size_tokens = s.num_blocks * s.block_size  # a model's pools together, as num_gpu_blocks
            concurrency = size_tokens / s.max_model_len if s.max_model_len else 0.0
            cache.add_metric([model, str(s.block_size), s.kv_cache_dtype, str(s.num_blocks),
                              str(s.enable_prefix_caching), str(size_tokens), f"{concurrency:.2f}"], 1)
        _add_histogram(iteration, model, s.iteration_tokens)
        _add_histogram(preemptions, model, s.request_num_preemptions)
        waiting.add_metric([model, "capacity"], s.num_waiting - s.num_waiting_deferred)
        waiting.add_metric([model, "deferred"], s.num_waiting_deferred)
        rejected.add_metric([model, "max_num_queued_reqs"], s.num_admission_rejections)  # --max-waiting
        rejected.add_metric([model, "max_num_queued_tokens"], 0)  # no token bound on the queue here
    lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests (the value: when taken).",
                             labels=["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    for model, s in stats.items():
        if s.max_loras:  # vLLM's labels: the adapters' names, comma-separated
            lora.add_metric([model, str(s.max_loras), ",".join(s.waiting_loras), ",".join(s.running_loras)], time.time())
    return families + [cache, iteration, preemptions, waiting, rejected, lora, *_spec_decode_families(stats)]


def _spec_decode_families(stats: dict[str, SchedulerStats]) -> list:
    """vLLM's spec_decode counters, for the models whose workers speculate (none where no model does)."""
    if not any(s.spec_decode for s in stats.values()):
        return []
    names = [("num_drafts", "Rows that verified draft tokens."), ("num_draft_tokens", "Draft tokens verified."),
             ("num_accepted_tokens", "Draft tokens accepted.")]
    families = [CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=["model_name"]) for name, doc in names]
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by their position among a row's drafts (0: the first).",
                                  labels=["model_name", "position"])
    for model, s in stats.items():
        if s.spec_decode is None:
            continue
        for family, (name, _) in zip(families, names, strict=True):
            family.add_metric([model], getattr(s.spec_decode, name))
        for position, n in enumerate(s.spec_decode.accepted_per_pos):
            per_pos.add_metric([model, str(position)], n)
    return [*families, per_pos]


def _add_histogram(family: HistogramMetricFamily, model: str, counts: HistogramCounts | None) -> None:
    if counts is not None:
        buckets = [(f"{float(le)}", n) for le, n in zip(counts.bounds, counts.counts, strict=True)]
        family.add_metric([model], buckets + [("+Inf", counts.count)], sum_value=counts.sum)


def _token_buckets() -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to 1M tokens (vLLM's 1-2-5 series)."""
    return tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


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
