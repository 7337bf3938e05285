"""A running batch's answered lines, in the JetStream stream SY_BATCH_LINES, so a taken-over batch
resumes where its last runner stopped; purged once the batch's output files are written."""

from __future__ import annotations

import msgspec
from nats.aio.client import Client

from services.api.streams import RecordStream
from shared.wire import subjects

STREAM = "SY_BATCH_LINES"
MAX_AGE_S = 3 * 24 * 3600  # longer than a batch may run (its 24 h completion window)
MAX_BYTES = 4 * 2**30


class Line(msgspec.Struct, array_like=True):
    index: int  # the line's place in the input file
    ok: bool  # to the output file (a 2xx answer), else to the error file
    record: dict  # the output file's line: {"id", "custom_id", "response", "error"}


class BatchLines:
    def __init__(self, nc: Client):
        self.js = nc.jetstream()
        self.stream = RecordStream(self.js, STREAM, [subjects.BATCH_LINES], MAX_AGE_S, MAX_BYTES)

    async def add(self, batch_id: str, line: Line) -> None:
        await self.stream.ensure()
        await self.js.publish(subjects.batch_lines(batch_id), msgspec.msgpack.encode(line), stream=STREAM)

    async def read(self, batch_id: str) -> dict[int, Line]:
        """Every line answered so far, by index (a line written twice, by two runners, counts once)."""
        lines: dict[int, Line] = {}
        async for msg in self.stream.read(subjects.batch_lines(batch_id)):
            line = msgspec.msgpack.decode(msg.data, type=Line)
            lines.setdefault(line.index, line)
        return lines

    async def purge(self, batch_id: str) -> None:
        await self.stream.ensure()
        await self.js.purge_stream(STREAM, subject=subjects.batch_lines(batch_id))
