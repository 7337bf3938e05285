"""The scheduler's statistics of a model (API -> scheduler, request/reply): the gateway's /metrics,
its load and vLLM's engine metrics read them."""

from __future__ import annotations

import msgspec

from shared.wire.histogram import HistogramCounts
from shared.wire.images import ImageSpec
from shared.wire.lora import LoraInfo
from shared.wire.messages import EmbeddingSpec
from shared.wire.spec_decode import SpecDecodeCounts


class SchedulerStatsRequest(msgspec.Struct, tag="sched_stats"):
    # wait (a little) for the Steps out to come back first: a metrics scrape right after a response
    # then counts the Step that made its last token, as vLLM's does
    settled: bool = False


class SchedulerStats(msgspec.Struct, tag="sched_stats_reply"):
    model: str
    num_workers: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, averaged over pools
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which were cached in a worker's pool
    external_prefix_cache_queries: int = 0  # prompt tokens looked up with a host KV tier
    external_prefix_cache_hits: int = 0  # of which the tier held (loaded, not computed)
    max_model_len: int = 0
    steps_run: int = 0  # Steps the pools ran (a multi-step Step counts once)
    step_seconds: float = 0.0  # summed round trip of every step (scheduler -> worker -> scheduler)
    forward_seconds: float = 0.0  # of which the workers spent in the step itself
    is_draining: bool = False
    num_deadline_exceeded: int = 0
    # the KV cache's configuration (vLLM's cache_config_info), over the model's pools
    block_size: int = 0
    kv_cache_dtype: str = ""
    num_blocks: int = 0
    enable_prefix_caching: bool = True
    # vLLM's histograms the engine observes: tokens per model iteration, preemptions per finished request
    iteration_tokens: HistogramCounts | None = None
    request_num_preemptions: HistogramCounts | None = None
    # vLLM's num_requests_waiting_by_reason: of the waiting, those held by a transient constraint
    # (no worker of the model, a LoRA slot) rather than by the batch's capacity
    num_waiting_deferred: int = 0
    num_admission_rejections: int = 0  # Submits refused for a full queue (--max-waiting)
    devices: list[str] = []  # what the model's workers run on (their hellos' device)
    architectures: list[str] = []  # what the model's workers loaded (their hellos' architecture)
    embedding: EmbeddingSpec | None = None  # as its workers announce it
    images: ImageSpec | None = None  # as its workers announce it
    num_migrations: int = 0  # requests moved off a worker that died, recomputed on another
    is_sleeping: bool = False  # sleep mode: the workers freed their weights and KV pool
    sleep_level: int = 0  # the level asked when it fell asleep (1 or 2); 0 awake
    loras: list[LoraInfo] = []  # the LoRA adapters its workers serve
    # vLLM's lora_requests_info: adapters one step may mix, and those of running and waiting requests
    max_loras: int = 0
    running_loras: list[str] = []
    waiting_loras: list[str] = []
    spec_decode: SpecDecodeCounts | None = None  # speculative decoding's counters (None: it is off)


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)  # vLLM's


SCHEDULER_STATS_DECODER = msgspec.msgpack.Decoder(SchedulerStats)

