"""POST /v1/completions and /v1/chat/completions, whole or streamed as SSE."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from services.api import openai_format as fmt
from services.api.chat_template import ChatTemplateError, render_chat
from services.api.context import ApiContext, ServedModel
from services.api.detokenizer import IncrementalDetokenizer
from services.api.errors import APIError
from services.api.generation import Delta, Generation
from services.api.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from shared.config import context_length_error
from shared.messages import SamplingParams

router = APIRouter()
DISCONNECT_POLL_S = 0.5
_json = msgspec.json.Encoder()


def _served(request: Request, name: str) -> tuple[ApiContext, ServedModel]:
    ctx: ApiContext = request.app.state.ctx
    if name not in ctx.models:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    return ctx, ctx.models[name]


def _sampling(body: _Sampling, max_tokens: int | None, num_prompt: int, model: ServedModel) -> SamplingParams:
    if body.n != 1:
        raise APIError(400, "n > 1 is not supported yet", param="n")
    if max_tokens is None:
        max_tokens = model.max_model_len - num_prompt
    too_long = context_length_error(model.max_model_len, num_prompt, max_tokens)
    if too_long:
        raise APIError(400, too_long, param="max_tokens", code="context_length_exceeded")
    if max_tokens < 1:
        raise APIError(400, f"the prompt ({num_prompt} tokens) leaves no room in the model's context "
                            f"of {model.max_model_len} tokens", param="messages")
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=max(body.top_k or 0, 0), seed=body.seed,
        stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, min_tokens=body.min_tokens)


def _prompt_ids(body: CompletionRequest, model: ServedModel) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = model.tokenizer.encode(prompt)
    elif all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
        if any(t < 0 or t >= model.tokenizer.vocab_size for t in ids):
            raise APIError(400, f"token ids must be in [0, {model.tokenizer.vocab_size})", param="prompt")
    else:
        raise APIError(400, "a list of several prompts is not supported yet", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    ctx, model = _served(request, body.model)
    if body.echo:
        raise APIError(400, "echo is not supported yet", param="echo")
    prompt_ids = _prompt_ids(body, model)
    sampling = _sampling(body, body.max_tokens or 16, len(prompt_ids), model)
    return await _respond(ctx, model, body, prompt_ids, sampling, request, is_chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx, model = _served(request, body.model)
    if not model.tokenizer.chat_template:
        raise APIError(400, f"model {model.name!r} has no chat template", param="messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = render_chat(model.tokenizer.chat_template, messages, bos_token=model.tokenizer.bos_token,
                           eos_token=model.tokenizer.eos_token, add_generation_prompt=body.add_generation_prompt)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None
    prompt_ids = model.tokenizer.encode(text)
    sampling = _sampling(body, body.max_completion_tokens or body.max_tokens, len(prompt_ids), model)
    return await _respond(ctx, model, body, prompt_ids, sampling, request, is_chat=True)


async def _respond(ctx: ApiContext, model: ServedModel, body: _Sampling, prompt_ids: list[int],
                   sampling: SamplingParams, request: Request, *, is_chat: bool):
    detokenizer = IncrementalDetokenizer(model.tokenizer.tokenizer, body.stop_strings)
    gen = Generation(ctx.bus, model.name, prompt_ids, sampling, detokenizer,
                     cache_salt=body.cache_salt, idle_timeout_s=ctx.idle_timeout_s)
    await gen.submit()
    request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{gen.stream.request_id}"
    created = int(time.time())
    if body.stream:
        events = _sse(gen, request_id, created, model.name, is_chat, body.include_usage)
        return EventSourceResponse(events, sep="\n")
    text, last = await _collect(gen, request)
    build = fmt.chat_completion if is_chat else fmt.completion
    return JSONResponse(build(request_id, created, model.name, text, last.finish_reason, last.usage))


async def _collect(gen: Generation, request: Request) -> tuple[str, Delta]:
    """Whole-response mode: gather the text, abort if the client goes away meanwhile."""
    parts: list[str] = []
    last: list[Delta] = []

    async def consume() -> None:
        async for delta in gen.deltas():
            parts.append(delta.text)
            last.append(delta)

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
    await task  # re-raises APIError or CancelledError
    return "".join(parts), last[-1]


async def _sse(gen: Generation, request_id: str, created: int, model: str, is_chat: bool,
               include_usage: bool) -> AsyncIterator[dict]:
    def data(obj: dict) -> dict:
        return {"data": _json.encode(obj).decode()}

    last: Delta | None = None
    try:
        if is_chat:
            yield data(fmt.chat_chunk(request_id, created, model, {"role": "assistant", "content": ""}, None))
        async for delta in gen.deltas():
            last = delta
            if is_chat:
                if delta.text:
                    yield data(fmt.chat_chunk(request_id, created, model, {"content": delta.text}, None))
                if delta.finish_reason:
                    yield data(fmt.chat_chunk(request_id, created, model, {}, delta.finish_reason))
            else:
                yield data(fmt.completion_chunk(request_id, created, model, delta.text, delta.finish_reason))
        if include_usage and last is not None and last.usage is not None:
            obj = "chat.completion.chunk" if is_chat else "text_completion"
            yield data(fmt.usage_chunk(request_id, created, model, obj, last.usage))
    except APIError as exc:  # the stream has started: report in-band so clients raise, not hang
        yield data(exc.body())
    yield {"data": "[DONE]"}
