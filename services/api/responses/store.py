"""Stored Responses API responses (`store: true`), for GET /v1/responses/{id} and previous_response_id.

A JetStream stream, SY_RESPONSES, one subject per response, bounded three ways: a response is kept
MAX_AGE_S (a day), the stream holds at most MAX_BYTES (256 MiB) and drops the oldest responses past
that, and a response larger than MAX_RESPONSE_BYTES is not stored (its answer says `store: false`).
"""

from __future__ import annotations

import msgspec
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from services.api.streams import RecordStream
from shared.log import get_logger
from shared.wire import subjects

log = get_logger("api")
STREAM = "SY_RESPONSES"
MAX_AGE_S = 24 * 3600
MAX_BYTES = 256 * 2**20
MAX_RESPONSE_BYTES = 4 * 2**20


class ResponseStore:
    def __init__(self, nc: Client):
        self.js = nc.jetstream()
        self.stream = RecordStream(self.js, STREAM, [subjects.STORED_RESPONSES], MAX_AGE_S, MAX_BYTES,
                                   max_msgs_per_subject=1)

    async def put(self, response_id: str, record: dict) -> bool:
        data = msgspec.json.encode(record)
        if len(data) > MAX_RESPONSE_BYTES:
            return False
        await self.stream.ensure()
        await self.js.publish(subjects.stored_response(response_id), data, stream=STREAM)
        return True

    async def get(self, response_id: str) -> dict | None:
        await self.stream.ensure()
        try:
            msg = await self.js.get_last_msg(STREAM, subjects.stored_response(response_id))
        except NotFoundError:
            return None
        return msgspec.json.decode(msg.data)
