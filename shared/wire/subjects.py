"""The only place a NATS subject string is spelled."""

import re

PREFIX = "sy.v1"
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-/]")


def token(name: str) -> str:
    """A name (a model's, a worker's) as one subject token: "Qwen/Qwen2.5-0.5B" has a dot, which
    would split it in two, so every character but [A-Za-z0-9_-/] is written %XX (distinct names
    stay distinct)."""
    return _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), name)


def submit(model: str) -> str:
    """Request/reply: Submit -> Accepted | Rejected."""
    return f"{PREFIX}.{token(model)}.submit"


def abort(model: str) -> str:
    return f"{PREFIX}.{token(model)}.abort"


def api_out(api_id: str) -> str:
    """Each API process reads every token for its requests here."""
    return f"{PREFIX}.out.{api_id}"


def tokens(model: str) -> str:
    """Observer subject: every step's tokens for a model."""
    return f"{PREFIX}.tokens.{token(model)}"


def worker_step(worker_id: str) -> str:
    """Request/reply: Step -> StepResult."""
    return f"{PREFIX}.worker.{token(worker_id)}.step"


WORKERS_HELLO = f"{PREFIX}.workers.hello"
WORKERS_HEARTBEAT = f"{PREFIX}.workers.heartbeat"
SCHEDULERS_HEARTBEAT = f"{PREFIX}.schedulers.heartbeat"  # bus clients end the streams of a silent scheduler
CLIENTS_HEARTBEAT = f"{PREFIX}.clients.heartbeat"  # schedulers abort the requests of a silent client
WORKERS_RESEND = f"{PREFIX}.workers.resend"  # bus clients ask for tokens an outage may have dropped
WORKERS_DISCOVER = f"{PREFIX}.workers.discover"  # schedulers ask workers to say hello again
MODEL_LIMITS = f"{PREFIX}.models.limits"  # schedulers publish each model's max_model_len


def kv_events(pool: str) -> str:
    return f"{PREFIX}.kv.events.{token(pool)}"


KV_EVENTS_ALL = f"{PREFIX}.kv.events.*"
KV_LOOKUP = f"{PREFIX}.kv.lookup"
KV_STATS = f"{PREFIX}.kv.stats"
KV_RESYNC = f"{PREFIX}.kv.resync"  # kvcache asks schedulers to republish what they hold


def stored_response(response_id: str) -> str:
    """JetStream (stream SY_RESPONSES): a stored Responses API response and its conversation."""
    return f"{PREFIX}.responses.{response_id}"


STORED_RESPONSES = f"{PREFIX}.responses.>"


def batch_lines(batch_id: str) -> str:
    """JetStream (stream SY_BATCH_LINES): a running batch's answered lines."""
    return f"{PREFIX}.batches.{batch_id}.lines"


BATCH_LINES = f"{PREFIX}.batches.*.lines"


def custom_predict(deployment: str) -> str:
    """Request/reply, queue group: a custom model's records, answered by its runtime process."""
    return f"{PREFIX}.custom.{token(deployment)}.predict"


def inference_log(pipeline: str, log_id: str) -> str:
    """JetStream (stream SY_INFERENCE_LOGS): one engine request served for a deployed pipeline."""
    return f"{PREFIX}.inference_logs.{token(pipeline)}.{log_id}"  # log_id may be "*"


INFERENCE_LOGS = f"{PREFIX}.inference_logs.>"


def background_cancel(response_id: str) -> str:
    """Request/reply: cancel a background response; the gateway running it answers with the Response."""
    return f"{PREFIX}.background.{response_id}.cancel"


def scheduler_stats(model: str) -> str:
    return f"{PREFIX}.{token(model)}.stats"


def sleep(model: str) -> str:
    """Request/reply: Sleep | WakeUp -> SleepState (the model's scheduler)."""
    return f"{PREFIX}.{token(model)}.sleep"


def worker_sleep(worker_id: str) -> str:
    """Request/reply: Sleep | WakeUp -> SleepState (one worker, from its pool's scheduler)."""
    return f"{PREFIX}.worker.{token(worker_id)}.sleep"


def lora(model: str) -> str:
    """Request/reply: LoadLora | UnloadLora -> LoraState (the model's scheduler, for every worker)."""
    return f"{PREFIX}.{token(model)}.lora"


def worker_kv_fetch(worker_id: str) -> str:
    """Request/reply: KvFetch -> KvFetched (a worker copies another host's tier slots into its own)."""
    return f"{PREFIX}.worker.{token(worker_id)}.kv_fetch"


def kv_held(model: str) -> str:
    """Request/reply: KvHeldQuery -> KvHeld (the model's scheduler: a prefill request's blocks held for its decode)."""
    return f"{PREFIX}.{token(model)}.kv_held"


def kv_tier_read(tier_id: str) -> str:
    """Request/reply: TierRead -> the slot's bytes, raw (any worker that maps the tier answers: a queue group)."""
    return f"{PREFIX}.kv.tier.{token(tier_id)}.read"


def worker_lora(worker_id: str) -> str:
    """Request/reply: LoadLora | UnloadLora -> LoraState (one worker, from its pool's scheduler)."""
    return f"{PREFIX}.worker.{token(worker_id)}.lora"


def service_stats(service: str, instance_id: str = "*") -> str:
    """nats.py micro's stats request: a service's every instance answers, or the one named."""
    return f"$SRV.STATS.{service}" if not instance_id else f"$SRV.STATS.{service}.{instance_id}"
