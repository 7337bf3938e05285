"""One engine request in flight at the API: submit, relay tokens as text deltas, finish with usage."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from services.api.errors import APIError
from services.api.metrics import ApiMetrics
from services.api.openai.format import Usage
from services.api.openai.kv_transfer import transfer_params
from shared.bus.client import BusClient, EngineUnavailable, RequestStream, SubmitRejected
from shared.log import get_logger
from shared.models.detokenizer import IncrementalDetokenizer
from shared.wire.images import ImageRef
from shared.wire.kv_events import KvTransferParams
from shared.wire.messages import FinishReason, Logprobs, RejectCode, SamplingParams, TokenEntry

if TYPE_CHECKING:
    from services.api.context import ApiContext, ServedModel

log = get_logger("api")
_REJECT_STATUS = {RejectCode.INVALID: 400, RejectCode.QUEUE_FULL: 429, RejectCode.UNAVAILABLE: 503,
                  RejectCode.NOT_FOUND: 404, RejectCode.IN_FLIGHT: 400}
_REJECT_CODE = {RejectCode.NOT_FOUND: "model_not_found"}  # OpenAI's; the others: the RejectCode's name
RETRY_AFTER_S = "1"  # what a 429 or 503 asks the client to wait


def submit_error(exc: EngineUnavailable | SubmitRejected) -> APIError:
    """A Submit the engine did not take, as the status that says why (a full queue: retry later)."""
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": RETRY_AFTER_S})
    retry = exc.code in (RejectCode.QUEUE_FULL, RejectCode.UNAVAILABLE)
    headers = {"Retry-After": RETRY_AFTER_S} if retry else None
    return APIError(_REJECT_STATUS[exc.code], exc.reason, code=_REJECT_CODE.get(exc.code, exc.code.name.lower()),
                    headers=headers)


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: list[Logprobs] | None = None  # one per token id, when asked
    prompt_logprobs: list[Logprobs | None] | None = None  # on the first delta, when asked
    # vLLM's stop_reason, on the last delta: the stop string or stop token id that ended the text
    # (None when another reason did, end of sequence included)
    stop_reason: str | int | None = None


FinishHook = Callable[["Generation"], None]  # called with a generation at its end (a pipeline's inference log)


class Generation:
    def __init__(self, bus: BusClient, model: str, prompt_ids: list[int], sampling: SamplingParams,
                 detokenizer: IncrementalDetokenizer, metrics: ApiMetrics, *, cache_salt: str | None,
                 idle_timeout_s: float, request_timeout_s: float, arrival: tuple[float, float],
                 user: str | None = None, priority: int = 0, lora: str | None = None,
                 on_finished: FinishHook | None = None, keeps_output: bool = False,
                 images: list[ImageRef] | None = None, kv_transfer: KvTransferParams | None = None):
        """arrival: (monotonic, wall clock) when the HTTP request reached the gateway (guards.arrival).
        user: OpenAI's end-user identifier, logged with the request for monitoring.
        priority: the scheduler serves lower first (vLLM's meaning).
        lora: the LoRA adapter of `model` to run on (None: the base model).
        on_finished: called at its end; keeps_output (implied by on_finished): output_ids and
        output_text hold what the client was sent.
        images: the prompt's images (an image-text model's), their pixels already in the media store.
        kv_transfer: vLLM's kv_transfer_params (kv_transfer.py)."""
        self.bus = bus
        self.kv_transfer = kv_transfer
        self.images = images or []
        self.priority = priority
        self.lora = lora
        self.user = user
        self.model = model
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.cache_salt = cache_salt
        self.idle_timeout_s = idle_timeout_s
        self.request_timeout_s = request_timeout_s
        self.arrival, self.arrival_wall = arrival
        self.first_token_at: float | None = None
        self.queue_time: float | None = None
        self.submitted_at: float | None = None  # monotonic, when the scheduler's Accepted arrived
        self.first_token_produced_at = 0.0  # wall clock on the worker, when it sampled the first token
        self.last_token_produced_at = 0.0  # and the latest
        self.first_byte_at: float | None = None  # monotonic, when the first delta left for the client
        self.stream: RequestStream | None = None
        self.num_cached_tokens = 0
        self.finish_reason = "abort"  # until the stream says otherwise: disconnect or timeout
        self.on_finished = on_finished
        self.keeps_output = keeps_output or on_finished is not None
        self.held_ids: list[int] = []  # tokens with no text yet (a split character, a possible stop string)
        self.num_taken = 0  # output tokens read from the stream (not those after a stop string in one entry)
        self.output_ids: list[int] = []
        self.output_text: list[str] = []

    async def submit(self) -> None:
        """Raises APIError with the right status if the engine does not take the request."""
        deadline = self.arrival_wall + self.request_timeout_s if self.request_timeout_s > 0 else 0.0
        try:
            self.stream = await self.bus.submit(self.model, self.prompt_ids, self.sampling,
                                                cache_salt=self.cache_salt, deadline=deadline,
                                                priority=self.priority, lora=self.lora, images=self.images,
                                                kv_transfer=self.kv_transfer)
        except (EngineUnavailable, SubmitRejected) as exc:
            raise submit_error(exc) from None
        self.submitted_at = time.monotonic()

    @property
    def num_output_tokens(self) -> int:
        return self.num_taken

    def usage(self) -> Usage:
        now = time.monotonic()
        ttft = (self.first_token_at or now) - self.arrival
        return Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=self.num_output_tokens,
                     cached_tokens=self.num_cached_tokens, ttft=ttft,
                     tps=self.num_output_tokens / max(now - self.arrival, 1e-9), timings=self.timings())

    def timings(self) -> dict[str, float] | None:
        """Seconds after the request's arrival at the API: the Submit received by the scheduler,
        its Accepted back at the API, first scheduled, first token sampled on the worker, first byte
        to the client; and engine_ttft, the engine's share of TTFT (Submit received to first token).
        arrived_at is that arrival itself (Unix time), so a client on the same clock can tell its
        request's way in from the first byte's way out.
        The gateway and the bus account for the rest of what the client sees. The Accepted's way
        back overlaps the engine's work, so it is not counted against either. Wall-clock stamps
        from other processes assume one clock."""
        if self.submitted_at is None or not self.first_token_produced_at:
            return None
        first_token = self.first_token_produced_at - self.arrival_wall
        submitted = self.submitted_at - self.arrival
        received = self.stream.received_at - self.arrival_wall if self.stream.received_at else submitted
        out = {"received": received, "submitted": submitted, "first_token": first_token,
               "engine_ttft": first_token - received, "arrived_at": self.arrival_wall}
        if self.queue_time is not None:
            out["scheduled"] = self.queue_time
        if self.first_byte_at is not None:
            out["first_byte"] = self.first_byte_at - self.arrival
        return out

    def request_metrics(self) -> dict[str, float]:
        """vLLM's per-request metrics (--enable-per-request-metrics), from the engine's stamps: the
        Submit received, first scheduled (the scheduler's clock), first and last token sampled (the
        worker's); one whose stamps are missing is left out, as vLLM leaves it null."""
        received = self.stream.received_at if self.stream else 0.0
        scheduled = self.arrival_wall + self.queue_time if self.queue_time is not None else 0.0
        first, last, n = self.first_token_produced_at, self.last_token_produced_at, self.num_output_tokens
        out = {}
        if scheduled and first:
            out["time_to_first_token_ms"] = (first - scheduled) * 1000
        if first and last:
            out["generation_time_ms"] = (last - first) * 1000
        if received and scheduled:
            out["queue_time_ms"] = (scheduled - received) * 1000
        if first and last and n > 1:
            out["mean_itl_ms"] = (last - first) / (n - 1) * 1000
        if scheduled and last > scheduled:
            out["tokens_per_second"] = n / (last - scheduled)
        return {k: max(v, 0.0) for k, v in out.items()}  # stamps of two processes' clocks: never below 0

    async def deltas(self) -> AsyncIterator[Delta]:
        assert self.stream is not None, "submit() first"
        is_done = False
        last_at = self.arrival
        try:
            async for entry in self.stream.entries(timeout=self.idle_timeout_s):
                now = time.monotonic()
                if self.first_token_at is None:
                    self.first_token_at = now
                    self.num_cached_tokens = entry.num_cached_tokens
                    self.first_token_produced_at = entry.produced_at
                    if entry.first_scheduled_at:
                        self.queue_time = entry.first_scheduled_at - self.arrival_wall
                elif entry.token_ids:
                    self.metrics.itl.labels(self.model).observe((now - last_at) / len(entry.token_ids))
                if entry.token_ids:
                    self.last_token_produced_at = entry.produced_at
                last_at = now
                if entry.finish_reason in (FinishReason.ERROR, FinishReason.TIMEOUT):
                    is_done = True
                    self.finish_reason = entry.finish_reason.openai_name
                    status = 504 if entry.finish_reason == FinishReason.TIMEOUT else 503
                    raise APIError(status, entry.error or "the engine failed this request",
                                   code=entry.finish_reason.openai_name)
                for piece in _one_by_one(entry) if self.detokenizer.stop else [entry]:
                    self.num_taken += len(piece.token_ids)
                    text = self.detokenizer.push(self._visible(piece))
                    delta = Delta(text, None, tuple(piece.token_ids), piece.logprobs, piece.prompt_logprobs)
                    if self.detokenizer.is_stopped:
                        self.finish_reason = delta.finish_reason = "stop"
                        delta.stop_reason = self.detokenizer.matched_stop
                        yield self._sent(delta)
                        return
                    if piece.finish_reason is not None:
                        is_done = True
                        self.finish_reason = delta.finish_reason = piece.finish_reason.openai_name
                        delta.stop_reason = self._stop_token(piece)
                        delta.text += self.detokenizer.flush()
                        yield self._sent(delta)
                        return
                    if text or delta.logprobs or delta.prompt_logprobs:
                        yield self._sent(delta)
                    else:  # they ride on the next delta sent (a delta with logprobs is always sent)
                        self.held_ids.extend(delta.token_ids)
        except TimeoutError:
            raise APIError(504, f"no token for {self.idle_timeout_s}s; the request was aborted",
                           code="timeout") from None
        finally:
            if not is_done:  # stop string, disconnect, timeout: the engine must let go
                await self.stream.abort()
            self._log_finished()

    def _sent(self, delta: Delta) -> Delta:
        if self.held_ids:
            delta.token_ids, self.held_ids = (*self.held_ids, *delta.token_ids), []
        if self.first_byte_at is None:
            self.first_byte_at = time.monotonic()
        if self.keeps_output:  # only where something reads it: an inference log, a replay
            self.output_ids.extend(delta.token_ids)
            self.output_text.append(delta.text)
        return delta

    def _visible(self, entry) -> list[int]:
        """A stop token id ends the text as a stop string does: its own text is not returned."""
        ids = entry.token_ids
        return ids[:-1] if self._stop_token(entry) is not None else ids

    def _stop_token(self, entry) -> int | None:
        """The stop token id (one the request named) that ended the sequence, if one did."""
        ids = entry.token_ids
        if entry.finish_reason == FinishReason.STOP and ids and ids[-1] in self.sampling.stop_token_ids:
            return ids[-1]
        return None

    def _log_finished(self) -> None:
        u = self.usage()
        self.metrics.observe_finished(
            self.model, ttft=u.ttft if self.first_token_at else None, e2e=time.monotonic() - self.arrival,
            queue_time=self.queue_time, num_prompt_tokens=u.prompt_tokens, num_output_tokens=u.completion_tokens,
            finish_reason=self.finish_reason)
        if self.queue_time is not None and self.first_token_produced_at and self.finish_reason in ("stop", "length"):
            self.metrics.observe_phases(self.model, self.arrival_wall + self.queue_time, self.first_token_produced_at,
                                        self.last_token_produced_at)
        if self.on_finished is not None:
            self.on_finished(self)
        log.info("request_finished", request_id=self.stream.request_id, model=self.model, user=self.user,
                 prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                 cached_tokens=u.cached_tokens, ttft_s=round(u.ttft, 4), finish_reason=self.finish_reason)


def _one_by_one(entry: TokenEntry) -> list[TokenEntry]:
    """An entry's tokens one at a time (a row that speculated sends several in one): where stop strings
    are checked, the tokens after the one that completes a stop string are then neither returned nor
    counted, as without speculation, where they are never computed."""
    if len(entry.token_ids) < 2:
        return [entry]
    last = len(entry.token_ids) - 1
    return [msgspec.structs.replace(
        entry, offset=entry.offset + i, token_ids=[token_id], finish_reason=entry.finish_reason if i == last else None,
        logprobs=entry.logprobs[i : i + 1] if entry.logprobs else entry.logprobs,
        prompt_logprobs=entry.prompt_logprobs if i == 0 else None) for i, token_id in enumerate(entry.token_ids)]


def engine_request(ctx: ApiContext, model: ServedModel, body, prompt_ids: list[int], sampling: SamplingParams,
                   arrival: tuple[float, float], *, stop: list[str] | None = None,
                   on_finished: FinishHook | None = None, images: list[ImageRef] | None = None) -> Generation:
    """One engine request of an OpenAI request (body: its cache_salt, user, priority, stop strings)
    on a served model, under the gateway's timeouts. stop: instead of the body's stop strings."""
    detokenizer = IncrementalDetokenizer(model.tokenizer.tokenizer, body.stop_strings if stop is None else stop)
    return Generation(ctx.bus, model.engine, prompt_ids, sampling, detokenizer, ctx.metrics,
                      cache_salt=body.cache_salt, idle_timeout_s=ctx.server.idle_timeout_s,
                      request_timeout_s=ctx.server.request_timeout_s, arrival=arrival, user=body.user,
                      priority=body.priority, lora=model.lora, on_finished=on_finished, images=images,
                      kv_transfer=transfer_params(body))
