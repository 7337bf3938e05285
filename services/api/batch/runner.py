"""Runs the Batch API's batches: each line through this gateway's own routes, at a low priority.

Every gateway runs one. A batch belongs to the gateway holding its lease (BatchRecord.owner,
renewed every RENEW_S); a lease left to lapse (a gateway gone) lets another take the batch over,
resuming after the lines already answered (batch/lines.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import httpx
import msgspec
from fastapi import FastAPI

from services.api.batch.batches import ACTIVE, BatchRecord, batch_store, read_input
from services.api.batch.files import file_store
from services.api.batch.lines import BatchLines, Line
from services.api.context import ApiContext
from shared.log import get_logger

log = get_logger("api")
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per batch line in the gateway's log
BATCH_PRIORITY = 1  # the scheduler serves lower first: interactive requests (0) go before batch lines
LEASE_S = 30.0
RENEW_S = 5.0
SCAN_S = 5.0  # how often a gateway looks for batches to run (a new one here starts at once)
EXPIRED = {"code": "batch_expired", "message": "This request could not be executed before the completion window "
                                               "expired."}


class BatchRunner:
    def __init__(self, ctx: ApiContext, app: FastAPI, concurrency: int):
        """concurrency: lines of one batch in flight at once."""
        self.ctx = ctx
        self.owner = ctx.bus.client_id
        self.concurrency = concurrency
        self.lines = BatchLines(ctx.nc)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://switchyard",
                                        timeout=None)
        self.running: dict[str, asyncio.Task] = {}
        self.settled: set[str] = set()  # batches seen finished: not read again
        self.wake = asyncio.Event()
        self._loop: asyncio.Task | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop().create_task(self._scan_forever())

    async def stop(self) -> None:
        """Lines in flight are aborted; their batches' leases lapse and another gateway resumes them."""
        for task in [self._loop, *self.running.values()]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._loop, *self.running.values()] if t], return_exceptions=True)
        await self.client.aclose()

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self._scan()
            except Exception as exc:  # the bus is away, say: look again later
                log.warning("batch_scan_failed", error=f"{type(exc).__name__}: {exc}")
            try:
                await asyncio.wait_for(self.wake.wait(), SCAN_S)
            except TimeoutError:
                pass
            self.wake.clear()

    async def _scan(self) -> None:
        store = batch_store(self.ctx)
        for batch_id in await store.ids():
            if self.ctx.server.is_draining:
                return
            if batch_id in self.running or batch_id in self.settled:
                continue
            got = await store.get(batch_id)
            if got is None:
                continue
            record, revision = got
            if record.batch.status not in ACTIVE:
                self.settled.add(batch_id)
                continue
            if record.owner != self.owner and record.lease_until > time.time():
                continue
            record.owner, record.lease_until = self.owner, time.time() + LEASE_S
            revision = await store.update(record, revision)
            if revision is not None:  # else another gateway took it first
                task = asyncio.get_running_loop().create_task(self._run(record, revision))
                self.running[batch_id] = task
                task.add_done_callback(lambda _, b=batch_id: self.running.pop(b, None))

    async def _run(self, record: BatchRecord, revision: int) -> None:
        batch = record.batch
        log.info("batch_running", batch_id=batch.id, status=batch.status)
        try:
            await _Run(self, record, revision).run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the lease lapses; this or another gateway tries again
            log.error("batch_run_failed", batch_id=batch.id, error=f"{type(exc).__name__}: {exc}")

    async def answer(self, item: dict) -> tuple[bool, dict]:
        """One line through this gateway's route: (a 2xx answer?, the output file's line)."""
        body = {**item["body"], "stream": False}
        body.setdefault("priority", BATCH_PRIORITY)
        headers = {"authorization": f"Bearer {self.ctx.server.api_keys[0]}"} if self.ctx.server.api_keys else None
        reply = await self.client.post(item["url"], content=msgspec.json.encode(body), headers=headers)
        try:
            answer = reply.json()
        except ValueError:
            answer = {"text": reply.text}
        request_id = answer.get("id") if isinstance(answer, dict) and isinstance(answer.get("id"), str) else ""
        return 200 <= reply.status_code < 300, {
            "id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item["custom_id"],
            "response": {"status_code": reply.status_code, "request_id": request_id, "body": answer}, "error": None}


class _Run:
    """One batch on this gateway, from its lease to its output files."""

    def __init__(self, runner: BatchRunner, record: BatchRecord, revision: int):
        self.runner, self.record, self.revision = runner, record, revision
        self.batch = record.batch
        self.store = batch_store(runner.ctx)
        self.files = file_store(runner.ctx)
        self.stopping = False  # no more lines are started

    async def run(self) -> None:
        batch, now = self.batch, int(time.time())
        data = await self.files.content(batch.input_file_id)
        requests, errors = read_input(data or b"", batch.endpoint)
        if data is None or errors:
            errors = errors or [{"code": "file_not_found", "message": f"{batch.input_file_id} was deleted",
                                 "param": "input_file_id", "line": None}]
            batch.status, batch.failed_at, batch.errors = "failed", now, {"object": "list", "data": errors}
            await self._save()
            return
        if batch.status == "validating":
            batch.status, batch.in_progress_at = "in_progress", now
        done = await self.runner.lines.read(batch.id)
        batch.request_counts.total = len(requests)
        batch.request_counts.completed = sum(line.ok for line in done.values())
        batch.request_counts.failed = len(done) - batch.request_counts.completed
        if not await self._save():
            return
        todo = [i for i in range(len(requests)) if i not in done]
        if batch.status == "in_progress" and todo:  # not when cancelled before it ran, or taken over finalizing
            it = iter(todo)
            workers = [asyncio.create_task(self._work(it, requests))
                       for _ in range(min(self.runner.concurrency, len(todo)))]
            if not await self._watch(workers):
                return  # the batch is another gateway's now
        await self._finalize(len(requests), requests)

    async def _work(self, todo, requests: list[dict]) -> None:
        for index in todo:
            if self.stopping:
                return
            ok, line = await self.runner.answer(requests[index])
            await self.runner.lines.add(self.batch.id, Line(index, ok, line))
            counts = self.batch.request_counts
            counts.completed, counts.failed = counts.completed + ok, counts.failed + (not ok)

    async def _watch(self, workers: list[asyncio.Task]) -> bool:
        """Renews the lease until the lines are done, a cancel, the window's end or a drain; False
        when the lease was lost."""
        try:
            while True:
                finished, _ = await asyncio.wait(workers, timeout=RENEW_S)
                for task in finished:
                    if task.exception() is not None:
                        raise task.exception()
                if len(finished) == len(workers):
                    return True
                if not await self._save():
                    return False
                if self.batch.status == "cancelling" or time.time() > self.batch.expires_at:
                    for task in workers:
                        task.cancel()  # lines in flight are aborted
                    await asyncio.gather(*workers, return_exceptions=True)
                    return True
                if self.runner.ctx.server.is_draining:  # lines in flight finish; the next gateway goes on
                    self.stopping = True
                    await asyncio.gather(*workers, return_exceptions=True)
                    self.record.lease_until = 0.0
                    await self._save()
                    return False
        finally:
            for task in workers:
                task.cancel()

    async def _save(self) -> bool:
        """Writes the record (and renews the lease), taking in a cancel another gateway wrote; False
        when another gateway owns the batch now."""
        if self.record.lease_until:
            self.record.lease_until = time.time() + LEASE_S
        revision = await self.store.update(self.record, self.revision)
        if revision is None:
            got = await self.store.get(self.batch.id)
            if got is None or got[0].owner != self.runner.owner:
                return False
            theirs, self.revision = got
            if theirs.batch.status == "cancelling" and self.batch.status in ("validating", "in_progress"):
                self.batch.status, self.batch.cancelling_at = "cancelling", theirs.batch.cancelling_at
            revision = await self.store.update(self.record, self.revision)
            if revision is None:
                return False
        self.revision = revision
        return True

    async def _finalize(self, num_requests: int, requests: list[dict]) -> None:
        batch = self.batch
        final = "cancelled" if batch.status == "cancelling" else \
            "expired" if time.time() > batch.expires_at else "completed"
        batch.status, batch.finalizing_at = "finalizing", int(time.time())
        if not await self._save():
            return
        lines = await self.runner.lines.read(batch.id)
        if final == "expired":
            for index in range(num_requests):
                if index not in lines:
                    lines[index] = Line(index, False, {"id": f"batch_req_{uuid.uuid4().hex}",
                                                       "custom_id": requests[index]["custom_id"],
                                                       "response": None, "error": EXPIRED})
        for ok, name in ((True, "output"), (False, "error")):
            records = [lines[i].record for i in sorted(lines) if lines[i].ok is ok]
            if records:
                data = b"\n".join(msgspec.json.encode(r) for r in records) + b"\n"
                file = await self.files.put(data, f"{batch.id}_{name}.jsonl", "batch_output")
                setattr(batch, f"{name}_file_id", file.id)
        batch.request_counts.completed = sum(line.ok for line in lines.values())
        batch.request_counts.failed = len(lines) - batch.request_counts.completed
        batch.status = final
        setattr(batch, f"{final}_at", int(time.time()))
        self.record.lease_until = 0.0
        if await self._save():
            await self.runner.lines.purge(batch.id)
            log.info("batch_done", batch_id=batch.id, status=final, completed=batch.request_counts.completed,
                     failed=batch.request_counts.failed)
