"""The worker on the bus: announce itself, run each Step, publish tokens straight to reply subjects.

A Step sent again (the scheduler lost our reply in a bus outage) gets the same reply without being
run twice; a client that lost tokens asks for them again (services/worker/resend.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from concurrent.futures import Executor

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.worker import memory
from services.worker.lora.adapter import LoraError
from services.worker.model_runner import ModelRunner, StepOutput
from services.worker.resend import SentTokens
from services.worker.tier_peer import TierPeer
from shared.bus.endpoints import Endpoints
from shared.bus.media import MediaStore
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.lora import LORA_ORDER_DECODER, LoadLora, LoraState
from shared.wire.messages import (
    DISCOVER_DECODER,
    RESEND_DECODER,
    STEP_DECODER,
    FinishReason,
    Sampled,
    StepResult,
    TokenBatch,
    TokenEntry,
    WorkerHeartbeat,
    WorkerHello,
    encode,
)
from shared.wire.sleep import SLEEP_ORDER_DECODER, Sleep, SleepState

log = get_logger("worker")
HEARTBEAT_INTERVAL_S = 1.0
QUIET_BEFORE_EXIT_S = 1.0  # draining: no sequence held and no step for this long means we are done


class WorkerService:
    def __init__(self, nc: Client, runner: ModelRunner, hello: WorkerHello, executor: Executor):
        self.nc = nc
        self.runner = runner
        self.hello = hello
        self._tasks: list[asyncio.Task] = []
        self.endpoints = Endpoints(nc, "worker", hello.worker_id)
        self.last_step_at = 0.0  # monotonic
        self.executor = executor  # where the forward runs: the main thread (see main_thread.py)
        self.sent = SentTokens(runner.seqs)
        self._last_reply: tuple[int, bytes] | None = None  # (step_id, the encoded StepResult)
        self._fence = 0  # the highest scheduler lease token seen on a Step (a lower one: a deposed leader)
        self._has_stepped = False  # a first Step must be a new pool's (reset): else it was for our predecessor
        self.media: MediaStore | None = None  # an image-text model's images (shared/bus/media.py), opened on first use

    async def start(self) -> None:
        await self.endpoints.add("step", subjects.worker_step(self.hello.worker_id), self._on_step)
        await self.endpoints.add("discover", subjects.WORKERS_DISCOVER, self._on_discover)
        await self.endpoints.add("resend", subjects.WORKERS_RESEND, self._on_resend)
        await self.endpoints.add("sleep", subjects.worker_sleep(self.hello.worker_id), self._on_sleep)
        await self.endpoints.add("lora", subjects.worker_lora(self.hello.worker_id), self._on_lora)
        if self.runner.tier is not None:  # its tier's slots read by other hosts, theirs fetched into it
            await TierPeer(self.nc, self.runner.tier, self.hello.worker_id).start(self.endpoints)
        await self.endpoints.start()
        await self.say_hello()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
        log.info("worker_ready", worker_id=self.hello.worker_id, model=self.hello.model,
                 num_blocks=self.hello.num_blocks)

    async def drain(self, grace_s: float) -> None:
        """Keep serving steps until the scheduler has nothing left for us (or the grace ends)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not self.runner.seqs and time.monotonic() - self.last_step_at > QUIET_BEFORE_EXIT_S:
                return
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.endpoints.stop()

    async def say_hello(self) -> None:
        await self.nc.publish(subjects.WORKERS_HELLO, encode(self.hello))

    async def _on_discover(self, msg: Msg) -> None:
        if DISCOVER_DECODER.decode(msg.data).model == self.hello.model:
            await self.say_hello()

    async def _heartbeat_loop(self) -> None:
        beat = WorkerHeartbeat(worker_id=self.hello.worker_id, model=self.hello.model)
        next_trim = time.monotonic() + memory.TRIM_INTERVAL_S
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            if time.monotonic() >= next_trim:  # off the loop: the trim takes a few ms and frees the GIL
                next_trim = time.monotonic() + memory.TRIM_INTERVAL_S
                await asyncio.get_running_loop().run_in_executor(None, memory.trim)
            beat.num_running, beat.bus_epoch = len(self.runner.seqs), self.nc.stats["reconnects"]
            try:
                await self.nc.publish(subjects.WORKERS_HEARTBEAT, encode(beat))
                await self._maybe_announce_device()
            except Exception as exc:  # the bus is down: the next beat will tell
                log.warning("heartbeat_failed", error=str(exc))

    async def _on_sleep(self, msg: Msg) -> None:
        """Sleep mode: free the weights and KV pool, or load them back (on the main thread, as a step)."""
        order = SLEEP_ORDER_DECODER.decode(msg.data)
        work = self.runner.sleep if isinstance(order, Sleep) else self.runner.wake_up
        error = None
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, work)
        except Exception as exc:  # noqa: BLE001 - told to the scheduler, which tells the caller
            log.exception("sleep_mode_failed", order=type(order).__name__)
            error = f"{type(exc).__name__}: {exc}"
        log.info("worker_sleeping" if self.runner.is_sleeping else "worker_awake", worker_id=self.hello.worker_id)
        await msg.respond(encode(SleepState(is_sleeping=self.runner.is_sleeping, error=error)))

    async def _on_lora(self, msg: Msg) -> None:
        """Load a LoRA adapter (read and checked on the main thread, between steps) or let one go."""
        order = LORA_ORDER_DECODER.decode(msg.data)
        lora = self.runner.lora
        error = None
        if lora is None:
            error = "LoRA adapters are not enabled on this model's workers (start them with --enable-lora)"
        elif isinstance(order, LoadLora):
            try:
                await asyncio.get_running_loop().run_in_executor(self.executor, lora.add, order.name, order.path)
            except LoraError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - an unreadable file: told to the caller
                error = f"LoRA adapter {order.name!r}: {type(exc).__name__}: {exc}"
        else:
            await asyncio.get_running_loop().run_in_executor(self.executor, lora.remove, order.name)
        self.hello.loras = lora.infos if lora else []
        await msg.respond(encode(LoraState(adapters=self.hello.loras, error=error)))

    async def _maybe_announce_device(self) -> None:
        """A device line that changed (a CPU worker's background compile ended, or failed) is said
        again, so /v1/models shows what computes now."""
        if self.runner.is_sleeping:
            return
        device = self.runner.backend.describe().device
        if device != self.hello.device:
            self.hello.device = device
            log.info("device_changed", device=device)
            await self.say_hello()

    async def _on_step(self, msg: Msg) -> None:
        step = STEP_DECODER.decode(msg.data)
        self.last_step_at = time.monotonic()
        if step.fence < self._fence:
            log.warning("step_fenced", step_id=step.step_id, fence=step.fence, newest=self._fence)
            await msg.respond(encode(StepResult(step_id=step.step_id, fenced=True, newest_fence=self._fence, error=(
                f"a scheduler with lease token {self._fence} leads; this Step carries {step.fence}"))))
            return
        self._fence = step.fence
        if not step.reset and not self._has_stepped:  # a pool's Step for this worker's process before us
            log.warning("step_for_another_process", step_id=step.step_id)
            await msg.respond(encode(StepResult(step_id=step.step_id, restarted=True, error=(
                "this worker restarted: the Step was for its process before, whose sequences are gone"))))
            return
        self._has_stepped = True
        if step.reset:
            self._last_reply = None
        elif self._last_reply is not None and self._last_reply[0] == step.step_id:
            log.info("step_repeated", step_id=step.step_id)  # our reply was lost: the same one again
            await msg.respond(self._last_reply[1])
            return
        await self._fetch_images(step)
        sampled, drafts, sizes, forward_seconds = [], [], [], 0.0
        for iteration in self.runner.iterations(step):  # one, or step.num_steps of them (multi-step)
            started = time.perf_counter()
            try:
                # the forward runs off the event loop so heartbeats keep flowing; torch frees the GIL
                out = await asyncio.get_running_loop().run_in_executor(self.executor, self.runner.execute, iteration)
            except Exception as exc:  # a failed step must not kill the worker: the scheduler fails its requests
                log.exception("step_failed", step_id=step.step_id)
                for seq in [*step.new_seqs, *step.scheduled]:
                    self.runner.seqs.pop(seq.request_id, None)
                await self._respond(msg, StepResult(step_id=step.step_id, error=f"{type(exc).__name__}: {exc}"))
                return
            forward_seconds += time.perf_counter() - started  # the step itself, not the publishing after it
            await self._publish_tokens(out)
            sampled.extend(out.sampled)
            drafts.extend(out.drafts)
            sizes.append(len(out.sampled))
        await self._respond(msg, StepResult(step_id=step.step_id, sampled=sampled, forward_seconds=forward_seconds,
                                            drafts=drafts, iteration_sizes=sizes if step.num_steps > 1 else []))
        self.last_step_at = time.monotonic()

    async def _fetch_images(self, step) -> None:
        """An image-text model's new images, from the media store; one that is not there fails its
        request alone when the step runs (ModelRunner.apply_deltas)."""
        images = self.runner.images_to_fetch(step)
        if not images:
            return
        self.media = self.media or MediaStore(self.nc)
        for image, pixels in zip(images, await asyncio.gather(*(self.media.get(i.key) for i in images)), strict=True):
            if pixels is None:
                log.warning("image_missing", key=image.key)
                continue
            try:
                self.runner.add_image(image, pixels)
            except ValueError as exc:
                log.warning("image_refused", key=image.key, error=str(exc))

    async def _respond(self, msg: Msg, result: StepResult) -> None:
        reply = encode(result)
        self._last_reply = (result.step_id, reply)
        await msg.respond(reply)

    async def _on_resend(self, msg: Msg) -> None:
        resend = RESEND_DECODER.decode(msg.data)
        entries = [e for rid, offset in resend.offsets.items()
                   if (e := self.sent.entry_from(rid, resend.reply_to, offset)) is not None]
        if entries:
            log.info("tokens_resent", reply_to=resend.reply_to, num_requests=len(entries))
            await self.nc.publish(resend.reply_to, encode(TokenBatch(entries=entries, worker_id=self.hello.worker_id)))

    async def _publish_tokens(self, out: StepOutput) -> None:
        """One TokenBatch per reply subject per step, plus the whole step on the observer subject."""
        if not out.sampled:
            return
        now = time.time()
        by_reply: dict[str, list[TokenEntry]] = defaultdict(list)
        entries: dict[str, TokenEntry] = {}  # a row that speculated keeps several tokens: one entry
        num_tokens = Counter(s.request_id for s in out.sampled if s.error is None)
        for sampled in out.sampled:
            if sampled.error is not None:
                continue  # a row that failed alone: the scheduler tells its client
            if (entry := entries.get(sampled.request_id)) is not None:
                entry.token_ids.append(sampled.token_id)
                entry.finish_reason = sampled.finish_reason
                continue
            seq = self.runner.seqs.get(sampled.request_id) or out.finished[sampled.request_id]
            pooled = seq.embedding is not None  # its one entry: the embedding, no token
            offset = 0 if pooled else seq.num_output_tokens - num_tokens[seq.request_id]
            entry = TokenEntry(request_id=seq.request_id, offset=offset, token_ids=[] if pooled else [sampled.token_id],
                               produced_at=now, finish_reason=sampled.finish_reason, embedding=seq.embedding,
                               logprobs=out.logprobs.get(seq.request_id))
            if offset == 0:  # per-request constants ride in the stream's first entry only
                entry.num_prompt_tokens = seq.num_prompt_tokens
                entry.num_cached_tokens = seq.num_cached_tokens
                entry.first_scheduled_at = seq.first_scheduled_at
                entry.prompt_logprobs = out.prompt_logprobs.get(seq.request_id)
            entries[seq.request_id] = entry
            by_reply[seq.reply_to].append(entry)
        for request_id, entry in entries.items():
            self.sent.record(self.runner.seqs.get(request_id) or out.finished[request_id], entry)
        all_entries = []
        for reply_to, subject_entries in by_reply.items():
            all_entries.extend(subject_entries)
            for batch in self._batches(subject_entries, out) if reply_to else []:
                await self.nc.publish(reply_to, batch)
        self.sent.remember_finished(out.finished)
        # the observer reads tokens, not logprobs: its batch stays small whatever the rows asked
        plain = [msgspec.structs.replace(e, logprobs=None, prompt_logprobs=None) for e in all_entries]
        await self.nc.publish(subjects.tokens(self.hello.model),
                              encode(TokenBatch(entries=plain, worker_id=self.hello.worker_id)))

    def _batches(self, entries: list[TokenEntry], out: StepOutput) -> list[bytes]:
        """The entries as one message, or one each where together they pass the bus's max payload;
        a row whose entry alone passes it (logprobs of a whole vocabulary over a long prompt) fails
        by itself, so the rows beside it go on and it is not left waiting."""
        whole = encode(TokenBatch(entries=entries, worker_id=self.hello.worker_id))
        if len(whole) <= self.nc.max_payload:
            return [whole]
        batches = []
        for entry in entries:
            alone = encode(TokenBatch(entries=[entry], worker_id=self.hello.worker_id))
            if len(alone) <= self.nc.max_payload:
                batches.append(alone)
                continue
            error = (f"this request's logprobs are {len(alone):,} bytes for one step, more than the bus carries in "
                     f"one message ({self.nc.max_payload:,}, nats-server's max_payload): ask for fewer")
            log.warning("row_too_large", request_id=entry.request_id, size=len(alone))
            out.sampled = [Sampled(request_id=s.request_id, token_id=-1, finish_reason=FinishReason.ERROR, error=error)
                           if s.request_id == entry.request_id else s for s in out.sampled]
            if (seq := self.runner.seqs.pop(entry.request_id, None)) is not None:
                out.finished[entry.request_id] = seq
        return batches
