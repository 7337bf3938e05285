"""One request in flight at the API: submit, relay tokens as text deltas, finish with usage."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.api.detokenizer import IncrementalDetokenizer
from services.api.errors import APIError
from services.api.openai_format import Usage
from shared.client import BusClient, EngineUnavailable, RequestStream, SubmitRejected
from shared.log import get_logger
from shared.messages import FinishReason, RejectCode, SamplingParams

log = get_logger("api")
_REJECT_STATUS = {RejectCode.INVALID: 400, RejectCode.QUEUE_FULL: 429, RejectCode.UNAVAILABLE: 503}


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None


class Generation:
    def __init__(self, bus: BusClient, model: str, prompt_ids: list[int], sampling: SamplingParams,
                 detokenizer: IncrementalDetokenizer, *, cache_salt: str | None, idle_timeout_s: float):
        self.bus = bus
        self.model = model
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.detokenizer = detokenizer
        self.cache_salt = cache_salt
        self.idle_timeout_s = idle_timeout_s
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.stream: RequestStream | None = None
        self.num_cached_tokens = 0
        self.finish_reason = "abort"  # until the stream says otherwise: disconnect or timeout

    async def submit(self) -> None:
        """Raises APIError with the right status if the engine does not take the request."""
        try:
            self.stream = await self.bus.submit(self.model, self.prompt_ids, self.sampling, cache_salt=self.cache_salt)
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        except SubmitRejected as exc:
            raise APIError(_REJECT_STATUS[exc.code], exc.reason, code=exc.code.name.lower()) from None

    def usage(self) -> Usage:
        now = time.monotonic()
        num_out = self.stream.num_tokens if self.stream else 0
        ttft = (self.first_token_at or now) - self.arrival
        return Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=num_out,
                     cached_tokens=self.num_cached_tokens, ttft=ttft, tps=num_out / max(now - self.arrival, 1e-9))

    async def deltas(self) -> AsyncIterator[Delta]:
        assert self.stream is not None, "submit() first"
        is_done = False
        try:
            async for entry in self.stream.entries(timeout=self.idle_timeout_s):
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                    self.num_cached_tokens = entry.num_cached_tokens
                if entry.finish_reason == FinishReason.ERROR:
                    is_done = True
                    self.finish_reason = "error"
                    raise APIError(503, entry.error or "the engine failed this request", code="engine_error")
                text = self.detokenizer.push(entry.token_ids)
                if self.detokenizer.is_stopped:
                    self.finish_reason = "stop"
                    yield Delta(text, "stop", self.usage())
                    return
                if entry.finish_reason is not None:
                    is_done = True
                    self.finish_reason = entry.finish_reason.openai_name
                    yield Delta(text + self.detokenizer.flush(), entry.finish_reason.openai_name, self.usage())
                    return
                if text:
                    yield Delta(text)
        except TimeoutError:
            raise APIError(503, f"no token for {self.idle_timeout_s}s; the request was aborted",
                           code="timeout") from None
        finally:
            if not is_done:  # stop string, disconnect, timeout: the engine must let go
                await self.stream.abort()
            u = self.usage()
            log.info("request_finished", request_id=self.stream.request_id, model=self.model,
                     prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                     cached_tokens=u.cached_tokens, ttft_s=round(u.ttft, 4), finish_reason=self.finish_reason)
