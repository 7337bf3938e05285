"""OpenAI batch objects and the JetStream key-value bucket SY_BATCHES that holds them, with their owner."""

from __future__ import annotations

import re

import msgspec
from nats.aio.client import Client
from nats.js.api import StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from shared.bus import replicas

BUCKET = "SY_BATCHES"
KEEP_S = 30 * 24 * 3600  # a batch record is dropped this long after its last change (its files stay)
BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a runner owns these


class RequestCounts(msgspec.Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(msgspec.Struct, omit_defaults=False):
    """OpenAI's batch object, as GET /v1/batches/{id} answers it."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"
    object: str = "batch"
    errors: dict | None = None  # {"object": "list", "data": [{"code", "message", "param", "line"}]}
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchRecord(msgspec.Struct):
    batch: Batch
    owner: str = ""  # the gateway (its bus client id) running it
    lease_until: float = 0.0  # wall clock; past it, any gateway may take the batch over


def batch_store(ctx) -> BatchStore:
    """The gateway's BatchStore (ApiContext.batch.batches), made on first use."""
    if ctx.batch.batches is None:
        ctx.batch.batches = BatchStore(ctx.nc)
    return ctx.batch.batches


class BatchStore:
    def __init__(self, nc: Client):
        self.js = nc.jetstream()
        self._kv = None

    async def _bucket(self):
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(BUCKET)
            except BucketNotFoundError:
                self._kv = await self.js.create_key_value(bucket=BUCKET, history=1, ttl=KEEP_S,
                                                          storage=StorageType.FILE, replicas=replicas())
        return self._kv

    async def create(self, record: BatchRecord) -> None:
        await (await self._bucket()).create(record.batch.id, msgspec.json.encode(record))

    async def get(self, batch_id: str) -> tuple[BatchRecord, int] | None:
        """The record and its revision (for update), or None."""
        if not BATCH_ID.match(batch_id):
            return None
        try:
            entry = await (await self._bucket()).get(batch_id)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return msgspec.json.decode(entry.value, type=BatchRecord), entry.revision

    async def update(self, record: BatchRecord, revision: int) -> int | None:
        """Compare-and-set: the new revision, or None when someone changed it since `revision`."""
        try:
            return await (await self._bucket()).update(record.batch.id, msgspec.json.encode(record), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def ids(self) -> list[str]:
        """Every batch id, from one snapshot of the bucket's stream (as Registry._keys)."""
        await self._bucket()
        info = await self.js.stream_info(f"KV_{BUCKET}", subjects_filter=f"$KV.{BUCKET}.>")
        return [s.split(".", 2)[2] for s in info.state.subjects or {}]


MAX_LINES = 50_000  # OpenAI's cap on requests in one batch


def read_input(data: bytes, endpoint: str) -> tuple[list[dict], list[dict]]:
    """The input file's requests, or the errors that fail the batch (OpenAI's: one per bad line)."""
    requests, errors, seen = [], [], set()

    def bad(number: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < 100:
            errors.append({"code": code, "message": message, "param": param, "line": number})

    text = data.decode("utf-8", errors="replace")
    # JSONL lines end at "\n" only: str.splitlines() would also cut at U+2028 and the like, which
    # JSON allows unescaped inside strings
    lines = [line for line in text.split("\n") if line.strip()]
    if len(lines) > MAX_LINES:
        bad(MAX_LINES + 1, "too_many_requests", f"a batch may hold at most {MAX_LINES} requests, got {len(lines)}")
        return [], errors
    for number, line in enumerate(lines, start=1):
        try:
            item = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            bad(number, "invalid_json_line", f"line {number} is not JSON: {exc}")
            continue
        if not isinstance(item, dict):
            bad(number, "invalid_request", f"line {number} is not a JSON object")
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            bad(number, "missing_required_parameter", f"line {number} needs a custom_id string", "custom_id")
        elif custom_id in seen:
            bad(number, "duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is used twice", "custom_id")
        elif item.get("method") != "POST":
            bad(number, "invalid_method", f"line {number}: method must be POST", "method")
        elif item.get("url") != endpoint:
            bad(number, "mismatched_endpoint", f"line {number}: url must be the batch's endpoint {endpoint}", "url")
        elif not isinstance(item.get("body"), dict):
            bad(number, "invalid_request", f"line {number}: body must be a JSON object", "body")
        else:
            seen.add(custom_id)
            requests.append(item)
    if not lines:
        bad(1, "empty_file", "the input file holds no requests")
    return requests, errors
