"""A running batch's answered lines, in the JetStream stream SY_BATCH_LINES, so a taken-over batch
resumes where its last runner stopped; purged once the batch's output files are written."""

from __future__ import annotations

import asyncio

import msgspec
from nats.aio.client import Client
from nats.js.api import DeliverPolicy, DiscardPolicy, StorageType, StreamConfig

from shared import subjects

STREAM = "SY_BATCH_LINES"
MAX_AGE_S = 3 * 24 * 3600  # longer than a batch may run (its 24 h completion window)
MAX_BYTES = 4 * 2**30
READ_TIMEOUT_S = 10.0


class Line(msgspec.Struct, array_like=True):
    index: int  # the line's place in the input file
    ok: bool  # to the output file (a 2xx answer), else to the error file
    record: dict  # the output file's line: {"id", "custom_id", "response", "error"}


class BatchLines:
    def __init__(self, nc: Client):
        self.js = nc.jetstream()
        self._ready = False

    async def _ensure(self) -> None:
        if not self._ready:
            await self.js.add_stream(StreamConfig(
                name=STREAM, subjects=[subjects.BATCH_LINES], max_age=MAX_AGE_S, max_bytes=MAX_BYTES,
                discard=DiscardPolicy.OLD, storage=StorageType.FILE))
            self._ready = True

    async def add(self, batch_id: str, line: Line) -> None:
        await self._ensure()
        await self.js.publish(subjects.batch_lines(batch_id), msgspec.msgpack.encode(line), stream=STREAM)

    async def read(self, batch_id: str) -> dict[int, Line]:
        """Every line answered so far, by index (a line written twice, by two runners, counts once)."""
        await self._ensure()
        subject = subjects.batch_lines(batch_id)
        info = await self.js.stream_info(STREAM, subjects_filter=subject)
        count = (info.state.subjects or {}).get(subject, 0)
        lines: dict[int, Line] = {}
        if count == 0:
            return lines
        sub = await self.js.subscribe(subject, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        try:
            while True:
                msg = await asyncio.wait_for(sub.next_msg(timeout=None), READ_TIMEOUT_S)
                line = msgspec.msgpack.decode(msg.data, type=Line)
                lines.setdefault(line.index, line)
                if msg.metadata.num_pending == 0:
                    return lines
        finally:
            await sub.unsubscribe()

    async def purge(self, batch_id: str) -> None:
        await self._ensure()
        await self.js.purge_stream(STREAM, subject=subjects.batch_lines(batch_id))
