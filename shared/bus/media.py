"""Images between the gateway and the workers: a JetStream object store holding each image's
resized pixels under its key (the file's sha256 and the size it was resized to), for an hour; a worker reads them
when a request's sequence reaches it (again after a preemption or a migration)."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.js.api import StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError

from shared.bus.connection import replicas

BUCKET = "SY_MEDIA"
MAX_AGE_S = 3600.0  # past this an image is gone: a request that still needs it fails alone, saying so
MAX_BUCKET_BYTES = 4 * 2**30  # every image together (Gemma 3's: 2.4 MB each)


def image_key(digest: str, width: int, height: int) -> str:
    return f"{digest}-{width}x{height}"


class MediaStore:
    def __init__(self, nc: Client):
        self.js = nc.jetstream()
        self._store = None
        self._lock = asyncio.Lock()

    async def _bucket(self):
        async with self._lock:
            if self._store is None:
                try:
                    self._store = await self.js.object_store(BUCKET)
                except BucketNotFoundError:
                    self._store = await self.js.create_object_store(
                        BUCKET, max_bytes=MAX_BUCKET_BYTES, storage=StorageType.FILE, replicas=replicas(),
                        ttl=MAX_AGE_S)
            return self._store

    async def put(self, key: str, data: bytes) -> None:
        """Once per image: a second request with the same one finds it there."""
        store = await self._bucket()
        try:
            info = await store.get_info(key)
            if not info.deleted:
                return
        except (NotFoundError, ObjectNotFoundError):
            pass
        await store.put(key, data)

    async def get(self, key: str) -> bytes | None:
        try:
            result = await (await self._bucket()).get(key)
        except (NotFoundError, ObjectNotFoundError, BucketNotFoundError):
            return None
        return result.data
