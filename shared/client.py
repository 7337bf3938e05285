"""Bus client: submit requests and read their token streams (the API uses it; so can anyone).

One subscription per client, at start, to its own reply subject; entries are routed to waiting
streams by request id, so no token is missed and no per-request subscription is needed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from shared import subjects
from shared.messages import (
    SUBMIT_REPLY_DECODER,
    TOKEN_BATCH_DECODER,
    Abort,
    RejectCode,
    Rejected,
    SamplingParams,
    Submit,
    TokenEntry,
    encode,
)


class EngineUnavailable(Exception):
    """No scheduler answered for the model (NATS no-responders or a timeout)."""


class SubmitRejected(Exception):
    def __init__(self, code: RejectCode, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _is_verdict(entry: TokenEntry) -> bool:
    """A terminal entry without tokens: the scheduler ending the request (deadline, error). Its
    offset is the scheduler's count of the tokens, which lags the worker's stream (the worker
    publishes straight to the reply subject, and a multi-step Step reports back only at its end),
    and other publishers' messages are not ordered with it: it ends the stream wherever it lands."""
    return entry.finish_reason is not None and not entry.token_ids


class RequestStream:
    """The entries of one request, in order; ends after the entry with a finish_reason."""

    def __init__(self, client: BusClient, model: str, request_id: str):
        self.client = client
        self.model = model
        self.request_id = request_id
        self.queue: asyncio.Queue[TokenEntry] = asyncio.Queue()
        self.num_tokens = 0
        self.is_finished = False
        self.worker_id = ""  # the worker that produced the latest tokens
        self.received_at = 0.0  # wall clock on the scheduler when it took the Submit (Accepted.received_at)

    async def entries(self, timeout: float | None = None) -> AsyncIterator[TokenEntry]:
        try:
            while not self.is_finished:
                if self.queue.empty():  # asyncio.timeout, not wait_for: no task per token
                    async with asyncio.timeout(timeout):
                        entry = await self.queue.get()
                else:
                    entry = self.queue.get_nowait()
                if entry.offset != self.num_tokens and not _is_verdict(entry):
                    raise RuntimeError(f"{self.request_id}: gap in token stream "
                                       f"(expected offset {self.num_tokens}, got {entry.offset})")
                self.num_tokens += len(entry.token_ids)
                self.is_finished = entry.finish_reason is not None
                yield entry
        finally:
            self.client.forget(self.request_id)

    async def abort(self) -> None:
        if not self.is_finished:
            self.is_finished = True
            await self.client.abort(self.model, [self.request_id])


class BusClient:
    def __init__(self, nc: Client, client_id: str | None = None):
        self.nc = nc
        self.client_id = client_id or uuid.uuid4().hex[:12]
        self.reply_subject = subjects.api_out(self.client_id)
        self.streams: dict[str, RequestStream] = {}
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.reply_subject, cb=self._on_tokens)
        await self.nc.flush()

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_tokens(self, msg) -> None:
        batch = TOKEN_BATCH_DECODER.decode(msg.data)
        for entry in batch.entries:
            stream = self.streams.get(entry.request_id)
            if stream is not None:
                stream.worker_id = batch.worker_id or stream.worker_id
                stream.queue.put_nowait(entry)

    async def submit(self, model: str, prompt_token_ids: list[int], sampling: SamplingParams, *,
                     request_id: str | None = None, cache_salt: str | None = None,
                     deadline: float = 0.0, timeout: float = 5.0) -> RequestStream:
        """deadline: wall-clock time after which the scheduler ends the request (0: none)."""
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(self, model, request_id)
        self.streams[request_id] = stream  # registered before Submit: the first token may beat the reply
        submit = Submit(request_id=request_id, model=model, prompt_token_ids=list(prompt_token_ids),
                        sampling=sampling, reply_to=self.reply_subject, arrival_time=time.time(),
                        cache_salt=cache_salt, deadline=deadline)
        try:
            msg = await self.nc.request(subjects.submit(model), encode(submit), timeout=timeout)
        except NoRespondersError:
            self.forget(request_id)
            raise EngineUnavailable(f"no scheduler is serving model {model!r}") from None
        except (TimeoutError, NatsTimeoutError):
            self.forget(request_id)
            raise EngineUnavailable(f"the scheduler for {model!r} did not answer within {timeout}s") from None
        reply = SUBMIT_REPLY_DECODER.decode(msg.data)
        if isinstance(reply, Rejected):
            self.forget(request_id)
            raise SubmitRejected(reply.code, reply.reason)
        stream.received_at = reply.received_at
        return stream

    async def abort(self, model: str, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.forget(request_id)
        await self.nc.publish(subjects.abort(model), encode(Abort(request_ids=list(request_ids))))

    def forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
