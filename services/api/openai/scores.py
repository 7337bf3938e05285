"""/score (vLLM's shape) and /rerank, /v1/rerank, /v2/rerank (vLLM's, Jina's and Cohere's shape): the
cosine similarity of two texts' embeddings, as vLLM scores with an embedding model, or a
cross-encoder's score of the pair read together."""

from __future__ import annotations

import time
import uuid

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from services.api.context import ApiContext, ServedModel
from services.api.errors import APIError
from services.api.guards import arrival
from services.api.off_loop import off_loop
from services.api.openai.body import parse
from services.api.openai.embeddings import embed, embedding_prompts, no_defaults
from services.api.openai.params import check_ready
from services.api.openai.protocol import _Request
from shared.wire.messages import Pooling

router = APIRouter()


class ScoreRequest(_Request):
    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0


class RerankRequest(_Request):
    model: str
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True  # Cohere's: each result carries its document's text
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0


@router.post("/score")
@router.post("/v1/score")
async def score_route(request: Request):
    return await score(request)


async def score(request: Request, model_name: str | None = None):
    ctx, model, body = await parse(request, ScoreRequest, no_defaults, model_name)
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if not seconds or len(firsts) != len(seconds):
        raise APIError(400, f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many "
                            "as text_2", param="text_2")
    scores, num_tokens = await similarities(ctx, model, request, list(zip(firsts, seconds, strict=True)),
                                            body.truncate_prompt_tokens, body.priority)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model.name, "data": data,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank_route(request: Request):
    return await rerank(request)


async def rerank(request: Request, model_name: str | None = None):
    ctx, model, body = await parse(request, RerankRequest, no_defaults, model_name)
    if not body.documents:
        raise APIError(400, "documents cannot be empty", param="documents")
    pairs = [(body.query, doc) for doc in body.documents]
    scores, num_tokens = await similarities(ctx, model, request, pairs, body.truncate_prompt_tokens, body.priority)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": model.name, "results": results,
                         "usage": {"total_tokens": num_tokens}})


async def similarities(ctx: ApiContext, model: ServedModel, request: Request, pairs: list[tuple[str, str]],
                       truncate: int | None, priority: int) -> tuple[list[float], int]:
    """Each pair's cosine similarity, every distinct text embedded once; and the tokens embedded."""
    check_ready(model)
    if model.embedding is not None and model.embedding.cross_encoder:
        return await _cross_scores(ctx, model, request, pairs, truncate, priority)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    prompts = await off_loop(embedding_prompts, model, texts, "input", True, truncate)
    vectors = dict(zip(texts, await embed(ctx, model, prompts, Pooling(), arrival(request)[1], priority),
                       strict=True))
    scores = [float(np.dot(vectors[a], vectors[b])) for a, b in pairs]  # unit vectors: the dot is the cosine
    return scores, sum(len(ids) for ids in prompts)


async def _cross_scores(ctx: ApiContext, model: ServedModel, request: Request, pairs: list[tuple[str, str]],
                        truncate: int | None, priority: int) -> tuple[list[float], int]:
    """A cross-encoder's: each pair as one input ([CLS] text_1 [SEP] text_2 [SEP]), its score the
    worker's one value (the classifier's logit through the model's activation)."""
    if truncate is not None:  # a pair is cut where it is longest, not from one end: not implemented
        raise APIError(400, "truncate_prompt_tokens is not supported for a cross-encoder's pairs",
                       param="truncate_prompt_tokens")
    prompts = await off_loop(lambda: embedding_prompts(model, [model.tokenizer.encode_pair(a, b) for a, b in pairs],
                                                       "text_2"))
    values = await embed(ctx, model, prompts, Pooling(normalize=False), arrival(request)[1], priority)
    return [float(v[0]) for v in values], sum(len(ids) for ids in prompts)
