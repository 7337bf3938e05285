"""Bus client: submit requests and read their token streams (the API uses it; so can anyone).

One subscription per client, at start, to its own reply subject; entries are routed to waiting
streams by request id, so no token is missed and no per-request subscription is needed. The client
heartbeats (a scheduler aborts the requests of a client gone quiet) and listens to the schedulers'
heartbeats (a request whose scheduler goes quiet ends with an error, not a silent stream; under a
leader lease it is submitted again, with the tokens read so far, to the standby that takes over).
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from shared.bus.liveness import CLIENT_HEARTBEAT_S, SCHEDULER_SILENCE_S, BusProbe, Heartbeats
from shared.bus.stream import RequestStream
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.images import ImageRef
from shared.wire.kv_events import KV_HELD_DECODER, KvHeld, KvHeldQuery, KvTransferParams
from shared.wire.messages import (
    SCHEDULER_HEARTBEAT_DECODER,
    SUBMIT_REPLY_DECODER,
    TOKEN_BATCH_DECODER,
    Abort,
    Accepted,
    ClientHeartbeat,
    FinishReason,
    RejectCode,
    Rejected,
    Resend,
    SamplingParams,
    Submit,
    TokenEntry,
    encode,
)

log = get_logger("bus")
WATCH_INTERVAL_S = 0.25
RESUME_WITHIN_S = 30.0  # a leased scheduler's requests wait this long for a standby to take them (lease.LEASE_S: 10 s)
RESUME_TRY_S = 0.25


class EngineUnavailable(Exception):
    """No scheduler answered for the model (NATS no-responders or a timeout)."""


class SubmitRejected(Exception):
    def __init__(self, code: RejectCode, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


class BusClient:
    def __init__(self, nc: Client, client_id: str | None = None):
        self.nc = nc
        self.client_id = client_id or uuid.uuid4().hex[:12]
        self.abort_key = secrets.token_hex(16)  # never on a subject: only this client can abort its requests
        self.reply_subject = subjects.api_out(self.client_id)
        self.streams: dict[str, RequestStream] = {}
        self.schedulers = Heartbeats(nc, SCHEDULER_SILENCE_S, probe=BusProbe.of(nc))  # a paused bus is no one's death
        self.leased: set[str] = set()  # schedulers that lead by a lease: a standby resumes their requests
        self._subs = []
        self._watch: asyncio.Task | None = None
        self._aborting: set[asyncio.Task] = set()
        self._leader_lost_at: float | None = None  # loop time a leased scheduler fell silent (a takeover)

    async def start(self) -> None:
        self._subs = [await self.nc.subscribe(self.reply_subject, cb=self._on_tokens),
                      await self.nc.subscribe(subjects.SCHEDULERS_HEARTBEAT, cb=self._on_scheduler_heartbeat)]
        await self.nc.flush()
        self.schedulers.probe.start()
        self._watch = asyncio.get_running_loop().create_task(self._heartbeat_and_watch())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for sub in self._subs:
            await sub.unsubscribe()

    async def _on_scheduler_heartbeat(self, msg) -> None:
        beat = SCHEDULER_HEARTBEAT_DECODER.decode(msg.data)
        self.schedulers.heard(beat.scheduler_id)
        if beat.lease:
            self.leased.add(beat.scheduler_id)

    async def _heartbeat_and_watch(self) -> None:
        beat, next_beat = encode(ClientHeartbeat(client_id=self.client_id)), 0.0
        loop = asyncio.get_running_loop()
        reconnects = self.nc.stats["reconnects"]
        while True:
            if self.nc.is_connected and self.nc.stats["reconnects"] != reconnects:
                reconnects = self.nc.stats["reconnects"]  # back on the bus: what was sent meanwhile may be lost
                await self.resend({rid: s.num_tokens for rid, s in self.streams.items() if not s.is_finished})
            if loop.time() >= next_beat:
                next_beat = loop.time() + CLIENT_HEARTBEAT_S
                try:
                    await self.nc.publish(subjects.CLIENTS_HEARTBEAT, beat)
                except Exception as exc:  # the bus is down: the next beat will tell
                    log.warning("heartbeat_failed", error=str(exc))
            for scheduler_id in self.schedulers.silent():
                self.schedulers.forget(scheduler_id)
                if scheduler_id in self.leased:
                    self.leased.discard(scheduler_id)
                    self._leader_lost_at = loop.time()
                    self._resume_streams_of(scheduler_id)
                else:
                    self._end_streams_of(scheduler_id)
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _is_taking_over(self) -> bool:
        """A leader was lost and no leased scheduler has been heard since, for RESUME_WITHIN_S at most."""
        return (self._leader_lost_at is not None and not self.leased
                and asyncio.get_running_loop().time() - self._leader_lost_at < RESUME_WITHIN_S)

    async def resend(self, offsets: dict[str, int]) -> None:
        """Ask the workers again for these requests' tokens from the given offsets on."""
        if offsets:
            try:
                await self.nc.publish(subjects.WORKERS_RESEND, encode(Resend(reply_to=self.reply_subject,
                                                                             offsets=offsets)))
            except Exception as exc:
                log.warning("resend_failed", error=str(exc))

    def _end_streams_of(self, scheduler_id: str) -> None:
        """The scheduler holding these requests is gone: each stream ends with an error entry."""
        orphans = [s for s in self.streams.values() if s.scheduler_id == scheduler_id]
        for stream in orphans:
            _fail(stream, f"the scheduler holding this request stopped ({SCHEDULER_SILENCE_S:g}s without a heartbeat)")
        log.warning("scheduler_gone", scheduler_id=scheduler_id, num_streams=len(orphans))

    def _resume_streams_of(self, scheduler_id: str) -> None:
        """A leader is gone: its requests go to whichever scheduler takes the lease over."""
        orphans = [s for s in self.streams.values() if s.scheduler_id == scheduler_id and not s.is_finished]
        log.warning("leader_gone", scheduler_id=scheduler_id, num_streams=len(orphans))
        for stream in orphans:
            task = asyncio.get_running_loop().create_task(self._resume(stream))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)

    async def _resume(self, stream: RequestStream) -> None:
        """Submit it again with the tokens read so far, until a scheduler takes it (RESUME_WITHIN_S).
        IN_FLIGHT means the one we thought lost holds it still (its heartbeats were late); UNAVAILABLE
        that the scheduler answering is shutting down (a leader with no worker yet holds a resumed
        request for --worker-grace-s rather than refuse it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESUME_WITHIN_S
        why = f"none took it over in {RESUME_WITHIN_S:g}s"
        while stream.request_id in self.streams and loop.time() < deadline:
            submit = msgspec.structs.replace(stream.submit, resume_token_ids=list(stream.token_ids), resumed=True)
            try:
                msg = await self.nc.request(subjects.submit(stream.model), encode(submit), timeout=RESUME_TRY_S * 4)
            except (NoRespondersError, TimeoutError, NatsTimeoutError):
                await asyncio.sleep(RESUME_TRY_S)  # no leader yet: the standby is taking the lease
                continue
            except Exception as exc:  # the bus away: the next try will tell
                log.warning("resume_failed", request_id=stream.request_id, error=str(exc))
                await asyncio.sleep(RESUME_TRY_S)
                continue
            reply = SUBMIT_REPLY_DECODER.decode(msg.data)
            if isinstance(reply, Rejected) and reply.code == RejectCode.UNAVAILABLE:
                why = reply.reason  # one shutting down: ask again, another will lead
                await asyncio.sleep(RESUME_TRY_S)
                continue
            if isinstance(reply, Rejected) and reply.code != RejectCode.IN_FLIGHT:
                _fail(stream, f"the request could not be resumed after its scheduler was lost: {reply.reason}")
            elif isinstance(reply, Accepted):
                self._held_by(stream, reply)
                log.info("request_resumed", request_id=stream.request_id, scheduler_id=reply.scheduler_id,
                         num_tokens=len(submit.resume_token_ids))
            return
        if stream.request_id in self.streams:
            _fail(stream, f"the scheduler holding this request stopped and it could not be resumed: {why}")

    async def _on_tokens(self, msg) -> None:
        batch = TOKEN_BATCH_DECODER.decode(msg.data)
        for entry in batch.entries:
            stream = self.streams.get(entry.request_id)
            if stream is not None:
                stream.queue.put_nowait((entry, batch.worker_id))

    async def submit(self, model: str, prompt_token_ids: list[int], sampling: SamplingParams, *,
                     request_id: str | None = None, cache_salt: str | None = None,
                     deadline: float = 0.0, priority: int = 0, timeout: float = 5.0,
                     lora: str | None = None, probe: bool = False, images: list[ImageRef] | None = None,
                     kv_transfer: KvTransferParams | None = None) -> RequestStream:
        """deadline: wall-clock time after which the scheduler ends the request (0: none).
        priority: lower is served first (vLLM's meaning); see Scheduler.schedule.
        lora: a LoRA adapter the model's workers serve, by name (None: the base model).
        probe: a readiness check's request, left out of the engine's metrics.
        images: an image-text model's images in the prompt, their pixels in the media store (shared/bus/media.py).
        kv_transfer: vLLM's kv_transfer_params (an outside router's disaggregated prefill; kv_held)."""
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(self, model, request_id)
        self.streams[request_id] = stream  # registered before Submit: the first token may beat the reply
        stream.submit = submit = Submit(request_id=request_id, model=model, prompt_token_ids=list(prompt_token_ids),
                        sampling=sampling, reply_to=self.reply_subject, arrival_time=time.time(),
                        cache_salt=cache_salt, deadline=deadline, client_id=self.client_id,
                        abort_key=self.abort_key, priority=priority, lora=lora, probe=probe, images=images or [],
                        kv_transfer=kv_transfer)
        retried = False
        while True:
            answer = asyncio.ensure_future(self.nc.request(subjects.submit(model), encode(submit), timeout=timeout))
            try:  # shielded: a caller that gives up meanwhile must not leave an accepted request running
                msg = await asyncio.shield(answer)
                break
            except asyncio.CancelledError:
                self.forget(request_id)
                answer.add_done_callback(lambda done: self._abort_if_accepted(model, request_id, done))
                raise
            except (NoRespondersError, TimeoutError, NatsTimeoutError) as exc:
                if self._is_taking_over():  # a standby takes the lease: the request waits for it
                    retried = True
                    await asyncio.sleep(RESUME_TRY_S)
                    continue
                self.forget(request_id)
                raise EngineUnavailable(f"no scheduler is serving model {model!r}" if isinstance(
                    exc, NoRespondersError) else f"the scheduler for {model!r} did not answer within {timeout}s") from None
        reply = SUBMIT_REPLY_DECODER.decode(msg.data)
        if isinstance(reply, Rejected) and reply.code == RejectCode.IN_FLIGHT and retried:
            return stream  # an earlier try was taken after all (its answer was lost in the takeover)
        if isinstance(reply, Rejected):
            self.forget(request_id)
            raise SubmitRejected(reply.code, reply.reason)
        stream.received_at = reply.received_at
        self._held_by(stream, reply)
        return stream

    async def kv_held(self, model: str, request_id: str, timeout: float = 10.0) -> KvHeld:
        """Where the scheduler holds the prompt blocks of a do_remote_decode request that ended at its
        length (for the decode request's kv_transfer_params); KvHeld.error when it holds none."""
        try:
            msg = await self.nc.request(subjects.kv_held(model), encode(KvHeldQuery(request_id)), timeout=timeout)
        except (NoRespondersError, TimeoutError, NatsTimeoutError) as exc:
            return KvHeld(error=f"the scheduler of {model!r} did not say: {type(exc).__name__}")
        return KV_HELD_DECODER.decode(msg.data)

    def _held_by(self, stream: RequestStream, reply: Accepted) -> None:
        """The scheduler that accepted it holds it now; its Accepted may beat its first heartbeat
        here, so whether it leads by a lease is taken from the reply as well."""
        stream.scheduler_id = reply.scheduler_id
        if reply.scheduler_id and reply.scheduler_id not in self.schedulers:
            self.schedulers.heard(reply.scheduler_id)
        if reply.lease:
            self.leased.add(reply.scheduler_id)

    def _abort_if_accepted(self, model: str, request_id: str, answer: asyncio.Future) -> None:
        """The Submit's answer came after its caller was cancelled: an accepted request is aborted."""
        if answer.cancelled() or answer.exception() is not None:
            return
        if not isinstance(SUBMIT_REPLY_DECODER.decode(answer.result().data), Rejected):
            task = asyncio.get_running_loop().create_task(self.abort(model, [request_id]))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)

    async def abort(self, model: str, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.forget(request_id)
        await self.nc.publish(subjects.abort(model), encode(Abort(request_ids=list(request_ids), abort_key=self.abort_key)))

    def forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)


def _fail(stream: RequestStream, error: str) -> None:
    """End a stream with an error entry (at the offset it has read to)."""
    stream.queue.put_nowait((TokenEntry(request_id=stream.request_id, offset=stream.num_tokens, token_ids=[],
                                        produced_at=time.time(), finish_reason=FinishReason.ERROR, error=error), ""))
