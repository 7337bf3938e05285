"""OpenAI files (the Batch API's input, output and error files) in a JetStream object store, SY_FILES."""

from __future__ import annotations

import re
import time
import uuid

import msgspec
from nats.aio.client import Client
from nats.js.api import ObjectMeta, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError

from shared.bus import replicas

BUCKET = "SY_FILES"
MAX_FILE_BYTES = 200 * 2**20  # OpenAI's cap on a batch input file
MAX_BUCKET_BYTES = 8 * 2**30  # every file together; an upload past it is refused with 507
FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")
PURPOSES = ("batch",)  # what a client uploads; the Batch API writes "batch_output" files itself


class FileObject(msgspec.Struct):
    """OpenAI's file object, as GET /v1/files/{id} answers it."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


def file_store(ctx) -> FileStore:
    """The gateway's FileStore (ApiContext.batch.files), made on first use."""
    if ctx.batch.files is None:
        ctx.batch.files = FileStore(ctx.nc)
    return ctx.batch.files


class FileStore:
    def __init__(self, nc: Client):
        self.js = nc.jetstream()
        self._store = None

    async def _bucket(self):
        if self._store is None:
            try:
                self._store = await self.js.object_store(BUCKET)
            except BucketNotFoundError:
                self._store = await self.js.create_object_store(BUCKET, max_bytes=MAX_BUCKET_BYTES,
                                                                storage=StorageType.FILE, replicas=replicas())
        return self._store

    async def put(self, data: bytes, filename: str, purpose: str) -> FileObject:
        file = FileObject(id=f"file-{uuid.uuid4().hex}", bytes=len(data), created_at=int(time.time()),
                          filename=filename, purpose=purpose)
        meta = ObjectMeta(name=file.id, description=msgspec.json.encode(file).decode())
        await (await self._bucket()).put(file.id, data, meta=meta)
        return file

    async def info(self, file_id: str) -> FileObject | None:
        if not FILE_ID.match(file_id):
            return None
        try:
            info = await (await self._bucket()).get_info(file_id)
        except (NotFoundError, ObjectNotFoundError):
            return None
        return None if info.deleted else msgspec.json.decode(info.description, type=FileObject)

    async def content(self, file_id: str) -> bytes | None:
        if await self.info(file_id) is None:
            return None
        return (await (await self._bucket()).get(file_id)).data

    async def list(self) -> list[FileObject]:
        try:
            infos = await (await self._bucket()).list()
        except NotFoundError:  # an empty bucket
            return []
        files = [msgspec.json.decode(i.description, type=FileObject) for i in infos if not i.deleted and i.description]
        return sorted(files, key=lambda f: f.created_at, reverse=True)

    async def delete(self, file_id: str) -> bool:
        if await self.info(file_id) is None:
            return False
        await (await self._bucket()).delete(file_id)
        return True
