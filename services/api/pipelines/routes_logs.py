"""A pipeline's inference log over HTTP: read it by time range (get_logs), re-run one record (replay)."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.guards import arrival
from services.api.openai.generation import Generation
from services.api.pipelines.routes_pipelines import find_pipeline, read_body
from shared.models.detokenizer import IncrementalDetokenizer

router = APIRouter(prefix="/v1/api/pipelines")
MAX_LIMIT = 10_000


def _number(body: dict, key: str, default=None):
    value = body.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise APIError(400, f"{key}: a number is required (Unix seconds), got {value!r}", param=key)
    return value


@router.post("/get_logs")
async def get_logs(request: Request) -> JSONResponse:
    """{"pipeline", "limit" (100), "start", "end" (Unix seconds)}: the newest `limit` records that
    finished in [start, end), oldest first."""
    body, registry = await read_body(request)
    pipeline = await find_pipeline(registry, body)
    limit = _number(body, "limit", 100)
    if not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise APIError(400, f"limit: an integer from 1 to {MAX_LIMIT} is required, got {limit!r}", param="limit")
    start, end = _number(body, "start"), _number(body, "end")
    ctx: ApiContext = request.app.state.ctx
    records = await ctx.pipelines.inference_log.read(pipeline.name, limit, start, end)
    return JSONResponse({"logs": msgspec.to_builtins(records)})


@router.post("/replay")
async def replay(request: Request) -> JSONResponse:
    """{"pipeline", "log_id", "model_version"}: the logged request run again, with its recorded
    prompt, sampling parameters, seed and stop strings, on the model version the pipeline serves now
    (a `model_version` other than that one is refused: deploy it first); says whether the output changed."""
    body, registry = await read_body(request)
    pipeline = await find_pipeline(registry, body)
    ctx: ApiContext = request.app.state.ctx
    log_id = body.get("log_id")
    if not isinstance(log_id, str) or not log_id.isalnum():
        raise APIError(400, "log_id: the log_id of an inference log record is required", param="log_id")
    record = await ctx.pipelines.inference_log.get(pipeline.name, log_id)
    if record is None:
        raise APIError(404, f"no inference log record {log_id!r} in pipeline {pipeline.name!r}", param="log_id",
                       code="log_not_found")
    if record.truncated:
        raise APIError(409, f"record {log_id!r} was too large to keep whole: it cannot be replayed", param="log_id")
    model = ctx.models.get(pipeline.deployment)
    if model is None or model.pipeline != pipeline.name or model.deployed is None:
        raise APIError(409, f"pipeline {pipeline.name!r} is not deployed here: deploy it to replay", code="not_deployed")
    serving = model.deployed.version
    wanted = body.get("model_version")
    if wanted is not None and wanted != serving.version:
        raise APIError(409, f"model_version {wanted!r} is not the one pipeline {pipeline.name!r} serves "
                       f"({serving.name} version {serving.version}): deploy it to replay against it",
                       param="model_version", code="version_not_deployed")
    gen = Generation(ctx.bus, model.name, record.prompt_token_ids, record.sampling,
                     IncrementalDetokenizer(model.tokenizer.tokenizer, record.stop), ctx.metrics, cache_salt=None,
                     idle_timeout_s=ctx.server.idle_timeout_s, request_timeout_s=ctx.server.request_timeout_s,
                     arrival=arrival(request), keeps_output=True)
    await gen.submit()
    async for _ in gen.deltas():
        pass
    return JSONResponse({
        "log_id": log_id, "pipeline": pipeline.name,
        "changed": "".join(gen.output_text) != record.output or gen.output_ids != record.output_token_ids,
        # greedy or seeded: the same model gives the same tokens in the same batch shape
        "reproducible": record.sampling.temperature == 0 or record.sampling.seed is not None,
        "logged": _outcome(record.model, record.model_version, record.output, record.output_token_ids,
                           record.finish_reason),
        "replayed": _outcome(serving.name, serving.version, "".join(gen.output_text), gen.output_ids,
                             gen.finish_reason)})


def _outcome(model: str, version: int, output: str, ids: list[int], finish_reason: str) -> dict:
    return {"model": model, "model_version": version, "output": output, "output_token_ids": ids,
            "finish_reason": finish_reason}


