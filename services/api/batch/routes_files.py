"""OpenAI's Files API: POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET /v1/files/{id}/content."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from nats.js.errors import APIError as JetStreamError
from starlette.datastructures import UploadFile

from services.api.batch.files import MAX_FILE_BYTES, PURPOSES, FileObject, file_store
from services.api.context import ApiContext
from services.api.errors import APIError

router = APIRouter()


async def file_info(ctx: ApiContext, file_id: str, param: str | None = None) -> FileObject:
    info = await file_store(ctx).info(file_id)
    if info is None:
        raise APIError(404, f"No such File object: {file_id}", param=param or "id", code="not_found")
    return info


@router.post("/v1/files")
async def upload_file(request: Request):
    form = await request.form(max_files=1, max_fields=4, max_part_size=1024)
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "the upload needs a `file` part", param="file")
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(PURPOSES)} (the only use files have here), "
                                f"got {purpose!r}", param="purpose")
        data = await upload.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise APIError(413, f"a file may be at most {MAX_FILE_BYTES // 2**20} MiB", param="file")
        if not data:
            raise APIError(400, "the file is empty", param="file")
        filename = (upload.filename or "upload.jsonl")[:256]
    finally:
        await form.close()
    try:
        file = await file_store(request.app.state.ctx).put(data, filename, purpose)
    except JetStreamError as exc:  # the bucket's cap (files.MAX_BUCKET_BYTES)
        raise APIError(507, f"file storage is full ({exc.description}); delete files and retry",
                       code="storage_full") from None
    return JSONResponse(msgspec.to_builtins(file))


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None):
    files = await file_store(request.app.state.ctx).list()
    data = [msgspec.to_builtins(f) for f in files if purpose is None or f.purpose == purpose]
    return JSONResponse({"object": "list", "data": data, "has_more": False})


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str):
    return JSONResponse(msgspec.to_builtins(await file_info(request.app.state.ctx, file_id)))


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str):
    data = await file_store(request.app.state.ctx).content(file_id)
    if data is None:
        raise APIError(404, f"No such File object: {file_id}", param="id", code="not_found")
    return Response(data, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    if not await file_store(request.app.state.ctx).delete(file_id):
        raise APIError(404, f"No such File object: {file_id}", param="id", code="not_found")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
