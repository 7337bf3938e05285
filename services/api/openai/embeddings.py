"""POST /v1/embeddings (OpenAI's shape; vLLM's extensions), and the pooling requests it and the
score routes (scores.py) submit: one engine request per input, all at once, so the inputs are
batched by the same continuous batching as generation (and share its prefix cache)."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from services.api.context import ApiContext, ServedModel
from services.api.errors import APIError
from services.api.guards import arrival
from services.api.off_loop import off_loop
from services.api.openai.body import parse
from services.api.openai.generation import submit_error
from services.api.openai.params import check_ready, check_token_ids, encode_text
from services.api.openai.protocol import _Request
from shared.bus.client import EngineUnavailable, RequestStream, SubmitRejected
from shared.log import get_logger
from shared.wire.messages import FinishReason, Pooling, SamplingParams

router = APIRouter()
log = get_logger("api")


def no_defaults(model: ServedModel) -> dict:
    """These routes take no per-model OpenAI defaults; like the others, they answer 404 for a
    deployment whose OpenAI API is off (body.parse)."""
    return {}


# one input: a text or its token ids; a request: one input or a list of them
EmbeddingInput = str | list[str] | list[int] | list[list[int]]
MAX_INPUTS = 2048  # OpenAI's cap on the inputs of one request


class EmbeddingRequest(_Request):
    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM's: the last k tokens kept
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS
    normalize: bool = True  # vLLM's: false gives the pooled hidden state as it is
    priority: int = 0  # vLLM's: lower is served first


@router.post("/v1/embeddings")
async def embeddings_route(request: Request):
    return await embeddings(request)


async def embeddings(request: Request, model_name: str | None = None):
    """model_name: set by a route whose path names the model (a pipeline's inference URL)."""
    ctx, model, body = await parse(request, EmbeddingRequest, no_defaults, model_name)
    check_ready(model)
    if model.embedding is not None and model.embedding.cross_encoder:
        raise APIError(400, f"The model {model.name!r} is a cross-encoder: it scores pairs of texts (/score, "
                            "/rerank), and gives no embeddings", param="model")
    prompts = await off_loop(embedding_prompts, model, body.input, "input", body.add_special_tokens,
                             body.truncate_prompt_tokens)
    pooling = Pooling(dimensions=checked_dimensions(model, body.dimensions), normalize=body.normalize)
    vectors = await embed(ctx, model, prompts, pooling, arrival(request)[1], body.priority)
    data = [{"object": "embedding", "index": i, "embedding": encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    num_tokens = sum(len(ids) for ids in prompts)
    log.info("embeddings_finished", model=model.name, user=body.user, num_inputs=len(prompts), num_tokens=num_tokens)
    return JSONResponse({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model.name, "data": data,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def embedding_prompts(model: ServedModel, value: EmbeddingInput, param: str, add_special_tokens: bool = True,
                      truncate: int | None = None) -> list[list[int]]:
    """One token-id list per input (a text, texts, token ids, or lists of them), each checked
    against the vocabulary and the context (the engine keeps one position past the prompt)."""
    if isinstance(value, str):
        prompts = [encode_text(model, value, param, add_special_tokens)]
    elif value and all(isinstance(t, int) for t in value):
        prompts = [list(value)]
    else:
        prompts = [encode_text(model, v, param, add_special_tokens) if isinstance(v, str) else list(v) for v in value]
    if not prompts or any(not ids for ids in prompts):
        raise APIError(400, f"{param} cannot be empty", param=param)
    if len(prompts) > MAX_INPUTS:
        raise APIError(400, f"{param} has {len(prompts)} inputs; at most {MAX_INPUTS} a request", param=param)
    if truncate is not None:
        k = max(model.max_model_len - 1, 0) if truncate == -1 else truncate
        prompts = [ids[len(ids) - k:] if k < len(ids) else ids for ids in prompts]
    for ids in prompts:
        check_token_ids(ids, model, param)
        if model.max_model_len and len(ids) >= model.max_model_len:
            raise APIError(400, f"This model's maximum context length is {model.max_model_len} tokens. However, you "
                                f"requested {len(ids)} tokens in the input for embedding generation. Please reduce "
                                "the length of the input.", param=param, code="context_length_exceeded")
    return prompts


def checked_dimensions(model: ServedModel, dimensions: int | None) -> int | None:
    """`dimensions` where the model's embeddings allow it (Matryoshka-trained); vLLM's words otherwise."""
    spec = model.embedding
    if dimensions is None or (spec is not None and dimensions == spec.size):
        return None
    if spec is None or spec.matryoshka is None:
        raise APIError(400, f'Model "{model.name}" does not support matryoshka representation, changing output '
                            "dimensions will lead to poor results.", param="dimensions")
    if dimensions > spec.size or (spec.matryoshka and dimensions not in spec.matryoshka):
        allowed = spec.matryoshka or f"1 to {spec.size}"
        raise APIError(400, f'Model "{model.name}" only supports {allowed} matryoshka dimensions, using other output '
                            "dimensions will lead to poor results.", param="dimensions")
    return dimensions


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


async def embed(ctx: ApiContext, model: ServedModel, prompts: list[list[int]], pooling: Pooling, arrived_at: float,
                priority: int = 0) -> list[np.ndarray]:
    """Each prompt's embedding (float32), submitted together; a failure of one aborts the others."""
    deadline = arrived_at + ctx.server.request_timeout_s if ctx.server.request_timeout_s > 0 else 0.0
    sampling = SamplingParams(max_tokens=1, pooling=pooling)
    streams: list[RequestStream] = []
    try:
        for ids in prompts:
            streams.append(await _submit(ctx, model, ids, sampling, deadline, priority))
        return list(await asyncio.gather(*(_pooled(s, ctx.server.idle_timeout_s) for s in streams)))
    except BaseException:
        await asyncio.gather(*(s.abort() for s in streams if not s.is_finished), return_exceptions=True)
        raise


async def _submit(ctx: ApiContext, model: ServedModel, ids: list[int], sampling: SamplingParams, deadline: float,
                  priority: int) -> RequestStream:
    try:
        return await ctx.bus.submit(model.engine, ids, sampling, deadline=deadline, priority=priority, lora=model.lora)
    except (EngineUnavailable, SubmitRejected) as exc:
        raise submit_error(exc) from None


async def _pooled(stream: RequestStream, idle_timeout_s: float) -> np.ndarray:
    try:
        async for entry in stream.entries(timeout=idle_timeout_s):
            if entry.embedding is not None:
                return np.frombuffer(entry.embedding, dtype="<f4")
            if entry.finish_reason in (FinishReason.ERROR, FinishReason.TIMEOUT):
                status = 504 if entry.finish_reason == FinishReason.TIMEOUT else 503
                raise APIError(status, entry.error or "the engine failed this request",
                               code=entry.finish_reason.openai_name)
    except TimeoutError:
        raise APIError(504, f"no embedding for {idle_timeout_s}s; the request was aborted", code="timeout") from None
    raise APIError(503, "the engine ended the request without an embedding", code="error")
