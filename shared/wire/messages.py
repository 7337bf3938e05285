"""Wire schemas: msgspec Structs, MessagePack-encoded. Fields are only appended, with defaults.

One decoder per subject lives next to the types (`*_DECODER`); never pickle. The hot path's
structs (a step and its result, token entries) are arrays without field names, and a token
entry's trailing, per-request fields default to values of one byte: a mid-stream entry is ~55
bytes, not ~205.
"""

from __future__ import annotations

import enum
from typing import NewType, Union

import msgspec

from shared.wire.images import ImageRef, ImageSpec
from shared.wire.kv_events import HostTierInfo, KvTransferParams
from shared.wire.lora import LoraInfo
from shared.wire.spec_decode import Drafts

RequestId = NewType("RequestId", str)
WorkerId = NewType("WorkerId", str)


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id, or (decided by the API) a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # client went away or asked to stop
    ERROR = 3  # the engine failed this request; `error` says why
    TIMEOUT = 4  # the request's deadline passed

    @property
    def openai_name(self) -> str:
        return {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "timeout"}[int(self)]


class RejectCode(enum.IntEnum):
    INVALID = 0  # -> HTTP 400
    QUEUE_FULL = 1  # -> HTTP 429
    UNAVAILABLE = 2  # no worker for the model -> HTTP 503
    NOT_FOUND = 3  # a LoRA adapter no worker of the model serves -> HTTP 404
    IN_FLIGHT = 4  # its request_id is held here already -> HTTP 400 (a resumed request: still ours)


class BackendName(enum.IntEnum):
    """What runs a worker's model (services/worker/backends/<name>/)."""

    TORCH_CPU = 0
    CUDA = 1
    QAIC = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class WorkerKind(enum.IntEnum):
    """How the scheduler gives a worker KV memory."""

    PAGED = 0  # blocks from the scheduler's block manager
    SLOTS = 1  # fixed per-sequence slots (static-shape programs: QAIC)

    @property
    def label(self) -> str:
        return self.name.lower()


class GuidedKind(enum.IntEnum):
    JSON_OBJECT = 0  # any JSON object
    JSON_SCHEMA = 1  # JSON valid against `schema`
    LARK = 2  # llguidance's Lark dialect (JSON schemas embedded with %json): forced tool calls, choices
    REGEX = 3  # text matching the regular expression in `schema`


class Guided(msgspec.Struct, frozen=True):
    """Constrained decoding: the worker masks every token the grammar does not allow."""

    kind: GuidedKind
    schema: str = ""  # JSON text of the schema (JSON_SCHEMA), or the grammar's text (LARK)


class Pooling(msgspec.Struct, frozen=True):
    """An embedding request's: its output is the prompt's last hidden state (last-token pooling, as
    a decoder embedder pools), cut to its first `dimensions` (Matryoshka) and L2-normalized, in
    place of tokens."""

    dimensions: int | None = None
    normalize: bool = True


class EmbeddingSpec(msgspec.Struct, frozen=True):
    """What a model's embeddings are (its workers announce it): the hidden size, and where it was
    Matryoshka-trained the sizes a request's `dimensions` may cut it to ([]: any up to `size`)."""

    size: int
    matryoshka: list[int] | None = None  # None: not Matryoshka-trained, only the whole vector
    encoder: bool = False  # a BERT-style encoder: it embeds and scores, and generates nothing
    cross_encoder: bool = False  # a reranker: it scores (text_1, text_2) pairs, one value each, and embeds nothing


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps every token
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None  # top alternatives per sampled token (0 = the sampled token's only)
    # vLLM's logprob_token_ids: these tokens' logprobs (and the sampled one's) in place of the top ones
    logprob_token_ids: list[int] = []
    prompt_logprobs: int | None = None  # the same for every prompt token; skips the prefix cache
    guided: Guided | None = None
    allowed_token_ids: list[int] = []  # when set, every other token is masked
    pooling: Pooling | None = None  # an embedding, not tokens: max_tokens is 1 and nothing is sampled

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


# ---- API -> scheduler ----------------------------------------------------------------------


class Submit(msgspec.Struct, tag="submit"):
    request_id: RequestId
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    arrival_time: float
    cache_salt: str | None = None
    deadline: float = 0.0  # wall clock after which the scheduler ends the request with an error (0: none)
    # the submitting BusClient, which heartbeats (ClientHeartbeat): its requests are aborted once it
    # falls silent; "" for a client that does not heartbeat
    client_id: str = ""
    abort_key: str = ""  # a secret of the submitter's: only an Abort that carries it ends the request
    # vLLM's priority: lower is served first (the Batch API's lines run at BATCH_PRIORITY); ties by arrival
    priority: int = 0
    lora: str | None = None  # the LoRA adapter to run on (its name); None: the base model
    # the output it already streamed, under a scheduler that was lost (BusClient resumes it with a
    # standby that took the lease): recomputed with the prompt, its stream going on at their offset
    resume_token_ids: list[int] = []
    # taken over from a lost scheduler: a leader with no worker yet holds it (--worker-grace-s), not refuses it
    resumed: bool = False
    probe: bool = False  # a readiness probe's: served as any request, left out of the engine's metrics
    images: list[ImageRef] = []  # an image-text model's images, in prompt order
    kv_transfer: KvTransferParams | None = None  # an outside router's disaggregated prefill (vLLM's)


class Accepted(msgspec.Struct, tag="accepted"):
    request_id: RequestId
    num_waiting: int = 0
    received_at: float = 0.0  # wall clock on the scheduler when the Submit arrived: the engine's clock starts
    scheduler_id: str = ""  # who holds the request now: its SchedulerHeartbeat stopping ends the stream
    lease: str = ""  # the lease it leads by (lease.py): when it falls silent a standby takes the request over


class Rejected(msgspec.Struct, tag="rejected"):
    request_id: RequestId
    code: RejectCode
    reason: str


SubmitReply = Union[Accepted, Rejected]


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[RequestId]
    abort_key: str = ""  # the Submit's: an Abort from anyone else is refused


class Resend(msgspec.Struct, tag="resend"):
    """A bus client asks the workers again for a request's tokens from `offset` on (after an outage
    may have dropped some): the worker holding it publishes them to reply_to in one entry."""

    reply_to: str
    offsets: dict[RequestId, int]


# ---- tokens back to whoever asked ----------------------------------------------------------


class Logprobs(msgspec.Struct, array_like=True):
    """One position: the chosen token's log-probability and the most likely alternatives."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int = 0  # of the chosen token in the distribution, 1 = the most likely (0: not computed)


class TokenEntry(msgspec.Struct, array_like=True):
    """New tokens of one request. Fields after `finish_reason` that are per-request constants
    (prompt size, cache hits, queue time, prompt logprobs) ride only in the request's first entry."""

    request_id: RequestId
    offset: int  # index of token_ids[0] among the request's output tokens; a reader detects gaps
    token_ids: list[int]
    produced_at: float = 0.0  # wall clock on the producer when the step finished
    finish_reason: FinishReason | None = None
    logprobs: list[Logprobs] | None = None  # one per token_ids entry, when the request asked
    error: str | None = None
    num_prompt_tokens: int = 0  # first entry only
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache; first entry only
    first_scheduled_at: float | None = None  # when the scheduler first ran it (queue time); first entry only
    prompt_logprobs: list[Logprobs | None] | None = None  # first entry only; the first prompt token's is None
    embedding: bytes | None = None  # a pooling request's (its only entry, no tokens): float32, little-endian


class TokenBatch(msgspec.Struct, tag="tokens", array_like=True):
    """All of one step's new tokens for one reply subject."""

    entries: list[TokenEntry]
    worker_id: str = ""


# ---- scheduler <-> worker ------------------------------------------------------------------


class NewSeq(msgspec.Struct, array_like=True):
    """A sequence the worker has no state for (first admission or recompute after preemption)."""

    request_id: RequestId
    token_ids: list[int]  # prompt, plus earlier outputs when recomputing
    num_prompt_tokens: int
    num_computed_tokens: int  # already in the KV cache (prefix hit)
    num_new_tokens: int  # to compute in this step
    block_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    num_cached_tokens: int = 0
    first_scheduled_at: float = 0.0
    lora: str | None = None  # the adapter its rows run on; None: the base model
    images: list[ImageRef] = []  # its prompt's images: their features take their tokens' place


class ScheduledSeq(msgspec.Struct, array_like=True):
    """A sequence the worker already holds: only the delta crosses the wire."""

    request_id: RequestId
    num_new_tokens: int
    num_computed_tokens: int  # the scheduler's count before this step: a worker whose own differs has drifted
    new_block_ids: list[int] = []
    num_lookahead: int = 0  # speculative decoding: slots past this token for up to this many drafts


class Step(msgspec.Struct, tag="step", array_like=True):
    step_id: int
    new_seqs: list[NewSeq] = []
    scheduled: list[ScheduledSeq] = []
    dropped_ids: list[RequestId] = []  # aborted or preempted: forget their state
    reset: bool = False  # first step of a new pool (e.g. a restarted scheduler): forget every sequence
    # multi-step: run this many decode iterations back to back (every row a decode row, with slots
    # allocated for all of them); a row leaves once it finishes. StepResult then lists each row's
    # tokens in order
    num_steps: int = 1
    # the sending scheduler's lease token (services/scheduler/lease.py; 0: no lease): a worker
    # refuses a Step with a token below one it has seen, from a leader that was deposed
    fence: int = 0
    # the host KV tier (services/worker/kv_tier.py), before the forward: (pool block, tier slot)
    # copied out of blocks being handed out again, then (tier slot, pool block) copied in for prefix hits
    kv_saves: list[tuple[int, int]] = []
    kv_loads: list[tuple[int, int]] = []
    # its disk spill (services/worker/kv_disk.py): (tier slot, disk slot) copied out of slots the saves
    # then overwrite, first of all; (disk slot, pool block) read into blocks for prefix hits, last
    kv_spills: list[tuple[int, int]] = []
    kv_disk_loads: list[tuple[int, int]] = []


class Sampled(msgspec.Struct, array_like=True):
    request_id: RequestId
    # -1 with finish_reason ERROR: this row failed (its `error` says why), the step did not;
    # -1 with STOP: a pooling row, finished with its embedding and no token
    token_id: int
    finish_reason: FinishReason | None = None
    error: str | None = None


class StepResult(msgspec.Struct, tag="step_result", array_like=True):
    step_id: int
    sampled: list[Sampled] = []  # in order; a row that speculated lists each token it keeps
    error: str | None = None
    forward_seconds: float = 0.0
    fenced: bool = False  # refused: a scheduler with a newer lease token leads
    drafts: list[Drafts] = []  # the rows that verified draft tokens (vLLM's spec_decode metrics)
    iteration_sizes: list[int] = []  # a multi-step Step's: how many of `sampled` each iteration added
    newest_fence: int = 0  # fenced: the newest lease token the worker has seen
    # refused: the worker's process restarted since this pool's first Step (a new one holds no sequence)
    restarted: bool = False


# ---- worker discovery ----------------------------------------------------------------------


class WorkerHello(msgspec.Struct, tag="hello"):
    """A worker's capabilities. Its KV geometry and max_model_len are the truth the scheduler
    allocates by and publishes onward (SchedulerStats.max_model_len is what the API checks)."""

    worker_id: WorkerId
    model: str
    backend: BackendName
    kind: WorkerKind
    num_blocks: int  # usable KV blocks (the null block not counted)
    block_size: int
    max_batch: int
    dtype: str
    max_model_len: int
    kv_cache_dtype: str = "auto"
    device: str = "cpu"  # e.g. "cuda:0 (NVIDIA H100 80GB HBM3)", "qaic, emulated on cpu"
    # a SLOTS worker: num_blocks counts its slots, block_size is a slot's ctx_len, and each step
    # prefills at most prefill_seq_len tokens of one sequence
    prefill_seq_len: int = 0
    vocab_size: int = 0  # the logits' width: the scheduler checks every token id of a Submit against it
    num_scheduler_steps: int = 1  # the worker's pick of decode iterations per Step, where the engine leaves it at 0
    architecture: str = ""  # the loaded model's Hugging Face class, e.g. "Qwen3ForCausalLM"
    embedding: EmbeddingSpec | None = None  # what /v1/embeddings gives for this model
    images: ImageSpec | None = None  # an image-text model's; None: text only
    max_loras: int = 0  # LoRA adapters one step may mix (0: it serves the base model alone)
    loras: list[LoraInfo] = []  # the adapters it serves (said again after each load and unload)
    num_speculative_tokens: int = 0  # drafts a decode row may verify per step (0: it does not speculate)
    spec_max_batch: int = 0  # ...in steps of at most this many running requests
    kv_tier: HostTierInfo | None = None  # --kv-offloading-size: its host tier (None: evicted blocks are gone)
    kv_role: str = "kv_both"  # --kv-transfer-config's: kv_producer (prefill), kv_consumer (decode) or both
    # new at each start of the worker's process: one back after it was declared gone as the same process
    # was paused or cut off from the bus, not crashed (the scheduler gives back the moves that cost)
    instance: str = ""


class WorkerHeartbeat(msgspec.Struct, tag="heartbeat"):
    worker_id: WorkerId
    model: str
    num_running: int = 0
    # its connection's reconnect count: after a reconnect (its NATS node died) its answers to Steps
    # it took before are refused (a reply is allowed once, on the connection the request came on),
    # so the scheduler sends an unanswered Step again
    bus_epoch: int = 0


class SchedulerHeartbeat(msgspec.Struct, tag="sched_heartbeat"):
    """A scheduler process is alive (every SCHEDULER_HEARTBEAT_S), with the models it serves."""

    scheduler_id: str
    models: list[str] = []
    # the lease it leads by ("": none). Bus clients resume a leased scheduler's requests with the
    # standby that takes the lease over, instead of ending them
    lease: str = ""


class ClientHeartbeat(msgspec.Struct, tag="client_heartbeat"):
    """A bus client (a gateway, an internal team's process) is alive and still wants its requests."""

    client_id: str


class Discover(msgspec.Struct, tag="discover"):
    model: str


class ModelLimits(msgspec.Struct, tag="limits"):
    """A model's context limit as its workers announce it, published by its scheduler when its set
    of workers changes; 0 while no worker serves the model. The API checks requests against it."""

    model: str
    max_model_len: int
    devices: list[str] = []  # what its workers run on, e.g. "cpu", "qaic, emulated on cpu"
    architectures: list[str] = []  # what its workers loaded (their hellos' architecture)
    embedding: EmbeddingSpec | None = None  # as its workers announce it
    loras: list[LoraInfo] = []  # the LoRA adapters its workers serve (/v1/models lists them)
    images: ImageSpec | None = None  # as its workers announce it; None: text only


# ---- encoding ------------------------------------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()
def encode(message: msgspec.Struct) -> bytes:
    return _ENCODER.encode(message)


SUBMIT_DECODER = msgspec.msgpack.Decoder(Submit)
SUBMIT_REPLY_DECODER = msgspec.msgpack.Decoder(SubmitReply)
ABORT_DECODER = msgspec.msgpack.Decoder(Abort)
RESEND_DECODER = msgspec.msgpack.Decoder(Resend)
TOKEN_BATCH_DECODER = msgspec.msgpack.Decoder(TokenBatch)
STEP_DECODER = msgspec.msgpack.Decoder(Step)
STEP_RESULT_DECODER = msgspec.msgpack.Decoder(StepResult)
WORKER_ANNOUNCE_DECODER = msgspec.msgpack.Decoder(Union[WorkerHello, WorkerHeartbeat])
SCHEDULER_HEARTBEAT_DECODER = msgspec.msgpack.Decoder(SchedulerHeartbeat)
CLIENT_HEARTBEAT_DECODER = msgspec.msgpack.Decoder(ClientHeartbeat)
DISCOVER_DECODER = msgspec.msgpack.Decoder(Discover)
MODEL_LIMITS_DECODER = msgspec.msgpack.Decoder(ModelLimits)
