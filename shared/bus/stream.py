"""One request's token stream at a bus client: entries in offset order, whatever order they arrive in.

Entries normally arrive in order, each once. After a bus outage a worker sends again what the
client may have missed (Resend), so an entry can come twice, overlap one already read, or arrive
ahead of a gap: duplicates are dropped, overlaps trimmed, and an entry past a gap waits until the
gap is filled (the stream asks for the missing tokens once per gap).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from shared.wire.messages import Submit, TokenEntry


class StreamOwner(Protocol):
    """What a stream asks of the client it belongs to (shared/bus/client.py's BusClient)."""

    async def resend(self, offsets: dict[str, int]) -> None:
        """Ask the workers for each request's tokens from the given offset on."""

    def forget(self, request_id: str) -> None:
        """The stream ended: entries for it are no longer routed to it."""

    async def abort(self, model: str, request_ids: list[str]) -> None:
        """The reader stopped early: the scheduler frees what the requests hold."""


def _is_verdict(entry: TokenEntry) -> bool:
    """A terminal entry without tokens: the scheduler ending the request (deadline, error). Its
    offset is the scheduler's count of the tokens, which lags the worker's stream (the worker
    publishes straight to the reply subject, and a multi-step Step reports back only at its end),
    and other publishers' messages are not ordered with it: it ends the stream wherever it lands."""
    return entry.finish_reason is not None and not entry.token_ids


def _trimmed(entry: TokenEntry, num_seen: int) -> TokenEntry:
    """The part of an entry past the num_seen tokens already read (the first entry's constants went with them)."""
    skip = num_seen - entry.offset
    return TokenEntry(request_id=entry.request_id, offset=num_seen, token_ids=entry.token_ids[skip:],
                      produced_at=entry.produced_at, finish_reason=entry.finish_reason,
                      logprobs=entry.logprobs[skip:] if entry.logprobs is not None else None, error=entry.error)


class RequestStream:
    """The entries of one request, in order; ends after the entry with a finish_reason."""

    def __init__(self, client: StreamOwner, model: str, request_id: str):
        self.client = client
        self.model = model
        self.request_id = request_id
        self.queue: asyncio.Queue[tuple[TokenEntry, str]] = asyncio.Queue()  # each entry with its worker
        self.num_tokens = 0
        self.is_finished = False
        self.worker_id = ""  # the worker that produced the latest tokens read (not one sent again)
        self.received_at = 0.0  # wall clock on the scheduler when it took the Submit (Accepted.received_at)
        self.scheduler_id = ""  # the scheduler holding it (Accepted.scheduler_id)
        self.submit: Submit | None = None  # what was submitted: sent again to resume it under a new leader
        self.token_ids: list[int] = []  # every token read so far (a resumed request starts after them)
        self._ahead: list[tuple[TokenEntry, str]] = []  # arrived past a gap
        self._asked_at = -1  # the offset a Resend was last asked from

    async def entries(self, timeout: float | None = None) -> AsyncIterator[TokenEntry]:
        try:
            while not self.is_finished:
                entry, worker_id = await self._next(timeout)
                if not _is_verdict(entry):
                    if entry.offset > self.num_tokens:  # past a gap: wait for the gap, ask for it once
                        self._ahead.append((entry, worker_id))
                        if self._asked_at != self.num_tokens:
                            self._asked_at = self.num_tokens
                            await self.client.resend({self.request_id: self.num_tokens})
                        continue
                    if entry.offset + len(entry.token_ids) <= self.num_tokens:
                        continue  # sent again after an outage, already read
                    if entry.offset < self.num_tokens:
                        entry = _trimmed(entry, self.num_tokens)
                self.worker_id = worker_id or self.worker_id
                self.num_tokens += len(entry.token_ids)
                self.token_ids += entry.token_ids
                self.is_finished = entry.finish_reason is not None
                yield entry
        finally:
            self.client.forget(self.request_id)

    async def _next(self, timeout: float | None) -> tuple[TokenEntry, str]:
        if self._ahead and (ready := [e for e in self._ahead if e[0].offset <= self.num_tokens]):
            entry = min(ready, key=lambda e: e[0].offset)
            self._ahead.remove(entry)
            return entry
        if self.queue.empty():  # asyncio.timeout, not wait_for: no task per token
            async with asyncio.timeout(timeout):
                return await self.queue.get()
        return self.queue.get_nowait()

    async def abort(self) -> None:
        if not self.is_finished:
            self.is_finished = True
            await self.client.abort(self.model, [self.request_id])
