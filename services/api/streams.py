"""The JetStream streams the gateway keeps records in: made once per process, read back in order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime

from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from shared.bus import replicas

READ_TIMEOUT_S = 10.0


class RecordStream:
    """A file-backed stream bounded by age and size, the oldest records dropped past either."""

    def __init__(self, js: JetStreamContext, name: str, subjects: list[str], max_age_s: float, max_bytes: int,
                 max_msgs_per_subject: int = -1):
        self.js = js
        self.config = StreamConfig(name=name, subjects=subjects, max_age=max_age_s, max_bytes=max_bytes,
                                   max_msgs_per_subject=max_msgs_per_subject, discard=DiscardPolicy.OLD,
                                   storage=StorageType.FILE, num_replicas=replicas())
        self._ready = False

    async def ensure(self) -> None:
        """Makes the stream, or takes in new limits where it exists with others."""
        if not self._ready:
            try:
                await self.js.add_stream(self.config)
            except BadRequestError:  # made before with other limits: the operator's latest choice wins
                await self.js.update_stream(self.config)
            self._ready = True

    async def read(self, subject: str, start: datetime | None = None) -> AsyncIterator:
        """The messages on a subject (wildcards allowed), oldest first, from `start` (stream time) on."""
        await self.ensure()
        policy = DeliverPolicy.BY_START_TIME if start is not None else DeliverPolicy.ALL
        config = ConsumerConfig(opt_start_time=start.isoformat() if start is not None else None)
        sub = await self.js.subscribe(subject, stream=self.config.name, ordered_consumer=True, deliver_policy=policy,
                                      config=config)
        try:
            info = await sub.consumer_info()
            if info.num_pending == 0 and not info.delivered.consumer_seq:
                return
            while True:
                msg = await asyncio.wait_for(sub.next_msg(timeout=None), READ_TIMEOUT_S)
                yield msg
                if msg.metadata.num_pending == 0:
                    return
        finally:
            await sub.unsubscribe()
