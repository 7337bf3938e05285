"""Each deployed pipeline's inference log: one JetStream record per engine request served for it
(stream SY_INFERENCE_LOGS, subject `sy.v1.inference_logs.<pipeline>.<log_id>`), bounded by age and size."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from contextlib import aclosing
from datetime import UTC, datetime

import msgspec
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from services.api.streams import RecordStream
from shared.gateway_config import GATEWAY_DEFAULTS
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.messages import SamplingParams

log = get_logger("api")
STREAM = "SY_INFERENCE_LOGS"
MAX_AGE_S = GATEWAY_DEFAULTS.inference_log_max_age_s  # --inference-log-max-age-s and --inference-log-max-bytes
MAX_BYTES = GATEWAY_DEFAULTS.inference_log_max_bytes
MAX_RECORD_BYTES = 2**20  # past it a record keeps its counts and timings, not its texts and token ids


class InferenceRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    log_id: str  # the engine request's id
    time: float  # when it finished (Unix time)
    pipeline: str
    deployment: str
    model: str
    model_version: int
    route: str  # "completions", "chat/completions", "responses" or "records"
    input: dict  # the request's prompt or messages, as sent
    output: str
    finish_reason: str
    sampling: SamplingParams  # the engine's parameters, its seed included (None: sampled unseeded)
    stop: list[str]  # the request's stop strings (the gateway ends the text at them)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    ttft_s: float | None
    e2e_s: float
    truncated: bool = False  # too large to keep whole: texts and token ids left out (not replayable)


_decoder = msgspec.json.Decoder(InferenceRecord)


class InferenceLog:
    def __init__(self, nc: Client, max_age_s: float = MAX_AGE_S, max_bytes: int = MAX_BYTES):
        self.nc = nc
        self.js = nc.jetstream()
        self.stream = RecordStream(self.js, STREAM, [subjects.INFERENCE_LOGS], max_age_s, max_bytes)
        self._writes: set[asyncio.Task] = set()

    def add(self, record: InferenceRecord) -> None:
        """Written after the answer, off the request's path; a failure is logged, never raised."""
        task = asyncio.get_running_loop().create_task(self._write(record))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, record: InferenceRecord) -> None:
        data = msgspec.json.encode(record)
        if len(data) > MAX_RECORD_BYTES:
            data = msgspec.json.encode(msgspec.structs.replace(
                record, input={}, output="", prompt_token_ids=[], output_token_ids=[], truncated=True))
        try:
            await self.stream.ensure()
            await self.js.publish(subjects.inference_log(record.pipeline, record.log_id), data, stream=STREAM)
        except Exception as exc:  # the bus is away: the answer went out, its record is lost and said so
            log.warning("inference_log_failed", log_id=record.log_id, error=f"{type(exc).__name__}: {exc}")

    async def flush(self) -> None:
        """Waits for the records being written (a drain, a test reading its own requests)."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def read(self, pipeline: str, limit: int, start: float | None = None,
                   end: float | None = None) -> list[InferenceRecord]:
        """The newest `limit` records that finished in [start, end) (Unix times), oldest first."""
        await self.flush()
        since = datetime.fromtimestamp(start, UTC) if start is not None else None
        newest: deque[InferenceRecord] = deque(maxlen=limit)
        async with aclosing(self.stream.read(subjects.inference_log(pipeline, "*"), since)) as messages:
            async for msg in messages:
                record = _decoder.decode(msg.data)
                if end is not None and record.time >= end + 1.0:  # stream order is finish order, to a few ms
                    break
                if (start is None or record.time >= start) and (end is None or record.time < end):
                    newest.append(record)
        return list(newest)

    async def get(self, pipeline: str, log_id: str) -> InferenceRecord | None:
        await self.flush()
        await self.stream.ensure()
        try:
            msg = await self.js.get_last_msg(STREAM, subjects.inference_log(pipeline, log_id))
        except NotFoundError:
            return None
        return _decoder.decode(msg.data)


def recorder(log: InferenceLog | None, model, body):
    """What each generation of a request calls at its end to log itself, where the model is a
    deployed pipeline's (None otherwise). model: a ServedModel; body: the OpenAI request."""
    if log is None or model.pipeline is None or model.deployed is None:
        return None
    if hasattr(body, "messages"):
        route, sent = "chat/completions", {"messages": [m.model_dump(exclude_none=True, exclude_defaults=True) for m in body.messages]}
    else:
        route, sent = "completions", {"prompt": body.prompt}
    stop = body.stop_strings

    def finished(gen) -> None:
        log.add(InferenceRecord(
            log_id=gen.stream.request_id, time=time.time(), pipeline=model.pipeline,
            deployment=model.name, model=model.deployed.version.name, model_version=model.deployed.version.version,
            route=route, input=sent, output="".join(gen.output_text), finish_reason=gen.finish_reason,
            sampling=gen.sampling, stop=stop, prompt_token_ids=gen.prompt_ids, output_token_ids=gen.output_ids,
            num_prompt_tokens=len(gen.prompt_ids), num_output_tokens=gen.num_output_tokens,
            num_cached_tokens=gen.num_cached_tokens,
            ttft_s=gen.first_token_at - gen.arrival if gen.first_token_at else None,
            e2e_s=time.monotonic() - gen.arrival))
    return finished
