"""A deployed pipeline's inference URLs, as the seed product spells them.

- `/v1/api/pipelines/infer/{deployment}/{pipeline}/openai/v1/completions` and `.../chat/completions`
  (and `.../embeddings`, `.../score`, `.../rerank`): the OpenAI routes for that deployment (the
  body's `model` may be left out); with
  `stream_options.include_usage` every chunk carries the usage so far, `ttft` and `tps` included.
- `/v1/api/pipelines/infer/{deployment}/{pipeline}`: the records route, one row
  `{"prompt", "max_tokens"}` in, `{"generated_text", "num_output_tokens"}` out; the model's Arrow
  input_schema checks each row, its output_schema picks and orders the output's fields. A custom
  model's rows go to its own predict (custom_records.py).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.guards import arrival
from services.api.off_loop import off_loop
from services.api.openai.body import read_json, validate
from services.api.openai.embeddings import embeddings
from services.api.openai.params import completion_prompts, sampling_params
from services.api.openai.protocol import CompletionRequest
from services.api.openai.routes import chat, choices_for, complete
from services.api.openai.scores import rerank, score
from services.api.pipelines.custom_records import custom_records
from services.api.pipelines.steps import step_model
from shared.control.arrow_schema import INPUTS, OUTPUTS, check_row, fields_of, shape_row

router = APIRouter(prefix="/v1/api/pipelines/infer/{deployment}/{pipeline}")
MULTI_ROW_ERROR = ("Continuous batching is not supported with more than one batch at a time, please send "
                   "requests with a single batch size or contact your Switchyard operator for support")


def _deployment(request: Request, deployment: str, pipeline: str, route: str = "completions") -> str:
    """The deployment's served name, if the URL's two parts agree (a pipeline of several steps: the
    step `route` goes to); 404 otherwise."""
    ctx: ApiContext = request.app.state.ctx
    served = ctx.models.get(deployment)
    if served is not None and served.pipeline == pipeline:
        return deployment
    if (step := step_model(ctx, deployment, pipeline, route)) is not None:
        return step
    if ctx.pipelines.pending.get(deployment) == pipeline:
        raise APIError(503, f"pipeline {pipeline!r} is deployed but not ready yet", code="model_not_ready")
    raise APIError(404, f"no deployment {deployment!r} of pipeline {pipeline!r}", code="deployment_not_found")


@router.post("/openai/v1/completions")
async def pipeline_completions(request: Request, deployment: str, pipeline: str):
    return await complete(request, _deployment(request, deployment, pipeline), usage_every_chunk=True)


@router.post("/openai/v1/chat/completions")
async def pipeline_chat_completions(request: Request, deployment: str, pipeline: str):
    return await chat(request, _deployment(request, deployment, pipeline), usage_every_chunk=True)


@router.post("/openai/v1/embeddings")
async def pipeline_embeddings(request: Request, deployment: str, pipeline: str):
    return await embeddings(request, _deployment(request, deployment, pipeline, "embeddings"))


@router.post("/openai/v1/score")
async def pipeline_score(request: Request, deployment: str, pipeline: str):
    return await score(request, _deployment(request, deployment, pipeline, "score"))


@router.post("/openai/v1/rerank")
async def pipeline_rerank(request: Request, deployment: str, pipeline: str):
    return await rerank(request, _deployment(request, deployment, pipeline, "rerank"))


@router.post("")
async def records(request: Request, deployment: str, pipeline: str) -> JSONResponse:
    """One row in, one row out. More than one row is refused where continuous batching is configured
    (the seed product's rule); a model without it takes the rows one after another."""
    ctx: ApiContext = request.app.state.ctx
    if deployment in ctx.pipelines.parents:
        raise APIError(400, f"pipeline {pipeline!r} has several steps: its OpenAI routes answer (embeddings, score "
                            "and rerank by its first step, completions and chat by its last), not records")
    model = ctx.models[_deployment(request, deployment, pipeline)]
    raw = await read_json_rows(request, ctx.server.max_body_bytes)
    if len(raw) > 1 and model.deployed.version.continuous_batching_config is not None:
        raise APIError(400, MULTI_ROW_ERROR, code="batch_size")
    version = model.deployed.version
    if version.framework == "custom":
        return JSONResponse(await custom_records(ctx, model, raw))
    inputs = fields_of("input_schema", version.input_schema, INPUTS)
    outputs = fields_of("output_schema", version.output_schema, OUTPUTS)
    out = []
    for i, row in enumerate(raw):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise APIError(400, f"row {i}: a record needs a string `prompt`", param="prompt")
        try:
            check_row(inputs, row, i)
        except ValueError as exc:
            raise APIError(400, str(exc), param="input_schema") from None
        fields = {"model": model.name, "prompt": row["prompt"]}
        if row.get("max_tokens") is not None:
            fields["max_tokens"] = row["max_tokens"]
        body = validate(CompletionRequest, fields, model.openai.completion)
        prompts = await off_loop(completion_prompts, body, model)
        sampling = sampling_params(body, model, len(prompts[0]), max_tokens=body.max_tokens or 16, logprobs=None)
        # rows run one after another: each one's clock starts when it does (row 0's at the request's arrival)
        started = arrival(request) if i == 0 else (time.monotonic(), time.time())
        choices = choices_for(ctx, model, body, prompts, [sampling], started)
        await choices.submit()
        text = [delta.text async for _, delta in choices.deltas()]
        out.append(shape_row(outputs, {"generated_text": "".join(text),
                                       "num_output_tokens": choices.usage().completion_tokens}))
    return JSONResponse(out)


async def read_json_rows(request: Request, max_bytes: int) -> list:
    """pandas-records JSON: a list of rows, or one row as an object, or columns of equal length."""
    raw = await read_json(request, max_bytes, allow_list=True)
    if isinstance(raw, dict) and raw and all(isinstance(v, list) for v in raw.values()):
        lengths = {len(v) for v in raw.values()}
        if len(lengths) != 1:
            raise APIError(400, "columns must have the same length")
        return [dict(zip(raw, values, strict=True)) for values in zip(*raw.values(), strict=True)]
    rows = raw if isinstance(raw, list) else [raw]
    if not rows:
        raise APIError(400, "no record was sent")
    return rows
