"""OpenAI's Batch API: POST/GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel."""

from __future__ import annotations

import time
import uuid
from typing import Literal

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from services.api.batch.batches import ENDPOINTS, Batch, BatchRecord, batch_store
from services.api.batch.routes_files import file_info
from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.openai.body import read_json, validate
from services.api.openai.protocol import _Request

router = APIRouter()
WINDOW_S = 24 * 3600


class BatchRequest(_Request):
    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"]  # OpenAI's only window
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


async def _batch(ctx: ApiContext, batch_id: str) -> tuple[BatchRecord, int]:
    got = await batch_store(ctx).get(batch_id)
    if got is None:
        raise APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id", code="not_found")
    return got


@router.post("/v1/batches")
async def create_batch(request: Request):
    ctx: ApiContext = request.app.state.ctx
    body = validate(BatchRequest, await read_json(request, ctx.server.max_body_bytes))
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}",
                       param="endpoint")
    file = await file_info(ctx, body.input_file_id, "input_file_id")
    if file.purpose != "batch":
        raise APIError(400, f"{file.id} has purpose {file.purpose!r}; a batch's input file needs 'batch'",
                       param="input_file_id")
    now = int(time.time())
    batch = Batch(id=f"batch_{uuid.uuid4().hex}", endpoint=body.endpoint, input_file_id=file.id,
                  completion_window=body.completion_window, created_at=now, expires_at=now + WINDOW_S,
                  metadata=body.metadata)
    await batch_store(ctx).create(BatchRecord(batch))
    runner = getattr(request.app.state, "batch_runner", None)
    if runner is not None:
        runner.wake.set()  # this gateway takes it at once
    return JSONResponse(msgspec.to_builtins(batch))


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20):
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be in [1, 100], got {limit}", param="limit")
    store = batch_store(request.app.state.ctx)
    batches = [got[0].batch for batch_id in await store.ids() if (got := await store.get(batch_id)) is not None]
    batches.sort(key=lambda b: (b.created_at, b.id), reverse=True)
    if after is not None:
        at = next((i for i, b in enumerate(batches) if b.id == after), None)
        if at is None:
            raise APIError(404, f"No batch found with id '{after}'.", param="after", code="not_found")
        batches = batches[at + 1:]
    page = batches[:limit]
    return JSONResponse({"object": "list", "data": msgspec.to_builtins(page),
                         "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                         "has_more": len(batches) > limit})


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str):
    record, _ = await _batch(request.app.state.ctx, batch_id)
    return JSONResponse(msgspec.to_builtins(record.batch))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str):
    """The runner sees `cancelling` at its next lease renewal, aborts the lines in flight and writes
    the answered ones to the output files; the batch ends `cancelled`."""
    ctx: ApiContext = request.app.state.ctx
    store = batch_store(ctx)
    for _ in range(10):  # a compare-and-set against the runner's renewals
        record, revision = await _batch(ctx, batch_id)
        if record.batch.status not in ("validating", "in_progress"):
            if record.batch.status in ("cancelling", "cancelled"):
                return JSONResponse(msgspec.to_builtins(record.batch))
            raise APIError(409, f"Cannot cancel a batch with status '{record.batch.status}'.",
                           param="batch_id", code="batch_not_cancellable")
        record.batch.status, record.batch.cancelling_at = "cancelling", int(time.time())
        if await store.update(record, revision) is not None:
            runner = getattr(request.app.state, "batch_runner", None)
            if runner is not None:
                runner.wake.set()
            return JSONResponse(msgspec.to_builtins(record.batch))
    raise APIError(503, "the batch kept changing; try again", param="batch_id", code="busy")
