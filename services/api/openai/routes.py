"""POST /v1/completions and /v1/chat/completions, whole or streamed as SSE."""

from __future__ import annotations

import asyncio
import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from services.api.context import ApiContext, ServedModel
from services.api.errors import APIError
from services.api.guards import arrival
from services.api.media.prompt import PromptImage, image_refs, store_images
from services.api.off_loop import off_loop
from services.api.openai.beam_search import BeamChoices, check_beam_request
from services.api.openai.body import parse
from services.api.openai.choices import Choices
from services.api.openai.generation import Generation, engine_request
from services.api.openai.kv_transfer import answer_params, check_one_choice, reused_prompt_ids
from services.api.openai.params import (
    chat_logprobs,
    choice_seed,
    completion_prompts,
    encode_text,
    render_messages,
    sampling_params,
    truncated,
    whole_vocabulary,
)
from services.api.openai.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from services.api.openai.reasoning import ReasoningSplitter
from services.api.openai.responder import ChatResponder, CompletionResponder, Responder
from services.api.openai.thinking import ThinkingGeneration
from services.api.openai.tools.choice import forced_grammar, plan_tools
from services.api.openai.tools.parsers import resolve as resolve_parser
from shared.wire.images import ImageRef
from shared.wire.messages import SamplingParams

router = APIRouter()
DISCONNECT_POLL_S = 0.5
_json = msgspec.json.Encoder()


@router.post("/v1/completions")
async def completions(request: Request):
    return await complete(request)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await chat(request)


async def complete(request: Request, model_name: str | None = None, usage_every_chunk: bool = False):
    """model_name: set by a route whose path names the model (a pipeline's inference URL)."""
    ctx, model, body = await parse(request, CompletionRequest, lambda m: m.openai.completion, model_name)
    prompts = await off_loop(completion_prompts, body, model)
    logprobs = whole_vocabulary(body.logprobs, model)
    echoed = logprobs if body.echo and logprobs is not None else None
    prompt_logprobs = max((n for n in (echoed, whole_vocabulary(body.prompt_logprobs, model)) if n is not None),
                          default=None)
    samplings = [sampling_params(body, model, len(ids), max_tokens=body.max_tokens or 16,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs) for ids in prompts]
    choices = choices_for(ctx, model, body, prompts, samplings, arrival(request))
    responder = CompletionResponder(model, body, prompts, choices.num_choices)
    return await _respond(choices, responder, body, request, usage_every_chunk)


async def chat(request: Request, model_name: str | None = None, usage_every_chunk: bool = False):
    ctx, model, body = await parse(request, ChatCompletionRequest, lambda m: m.openai.chat, model_name)
    images = await store_images(ctx, model, body.messages, body.mm_processor_kwargs)
    choices, responder = await off_loop(chat_generation, ctx, model, body, arrival(request), images)
    return await _respond(choices, responder, body, request, usage_every_chunk)


def chat_generation(ctx: ApiContext, model: ServedModel, body: ChatCompletionRequest,
                    arrived: tuple[float, float], images: list[PromptImage]) -> tuple[Choices, ChatResponder]:
    """A validated chat request as engine requests, and the responder that reads them back.
    images: its image parts, stored, in order (store_images)."""
    tools = plan_tools(body, resolve_parser(ctx.tool_call_parser, model.chat_template))
    if (reused := reused_prompt_ids(body, bool(images))) is not None:  # a disaggregated decode's (vLLM's)
        prompt_ids, text = reused, model.tokenizer.decode(reused, skip_special_tokens=False)
    else:
        text = render_messages(model, body.messages, body.add_generation_prompt, body.tools if tools else None,
                               body.continue_final_message, body.chat_template_kwargs, images)
        prompt_ids = truncated(encode_text(model, text, "messages"), body, model)
    refs = image_refs(prompt_ids, model.images, images)
    sampling = sampling_params(body, model, len(prompt_ids), max_tokens=body.max_completion_tokens or body.max_tokens,
                               logprobs=whole_vocabulary(chat_logprobs(body), model),
                               prompt_logprobs=whole_vocabulary(body.prompt_logprobs, model))
    if tools is not None and (forced := forced_grammar(tools)) is not None:
        if sampling.guided is not None:
            raise APIError(400, "response_format cannot be combined with a tool_choice that forces a call",
                           param="response_format")
        sampling = msgspec.structs.replace(sampling, guided=forced)
    parser = ctx.reasoning_parser
    splitter = (lambda: ReasoningSplitter(parser, text)) if parser else None
    thinks_first = splitter is not None and splitter().in_reasoning
    if body.thinking_token_budget is not None and not thinks_first:
        raise APIError(400, "thinking_token_budget needs a reasoning parser (--reasoning-parser) and a prompt "
                            "that opens the thinking (the chat template's <think>)", param="thinking_token_budget")
    if thinks_first and (sampling.guided is not None or body.thinking_token_budget is not None):
        choices = thinking_choices(ctx, model, body, prompt_ids, sampling, arrived, refs)  # the grammar after the thinking
    else:
        choices = choices_for(ctx, model, body, [prompt_ids], [sampling], arrived, refs)
    return choices, ChatResponder(model, body, choices.num_choices, tools, prompt_ids, reasoning=splitter)


def thinking_choices(ctx: ApiContext, model: ServedModel, body: ChatCompletionRequest, prompt_ids: list[int],
                     sampling: SamplingParams, arrived: tuple[float, float], images: list[ImageRef]) -> Choices:
    """Each choice thinks, then answers under the request's grammar (thinking.py); its prompt's
    images stay where they are in the prompts it continues."""
    def make(ids: list[int], params: SamplingParams, stop: list[str]) -> Generation:
        return engine_request(ctx, model, body, ids, params, arrived, stop=stop, images=images)

    ctx.metrics.observe_params(model.name, body.n, sampling.max_tokens)
    hook = ctx.finish_hook(model, body)
    generations = [ThinkingGeneration(make, prompt_ids, msgspec.structs.replace(sampling, seed=choice_seed(sampling.seed, j)),
                                      body.stop_strings, body.thinking_token_budget,
                                      lambda text: model.tokenizer.encode(text, add_special_tokens=False),
                                      on_finished=hook)
                   for j in range(body.n)]
    return Choices(generations, [0] * body.n)


def choices_for(ctx: ApiContext, model: ServedModel, body: _Sampling, prompts: list[list[int]],
                samplings: list[SamplingParams], arrived: tuple[float, float],
                images: list[ImageRef] | None = None) -> Choices | BeamChoices:
    """images: a chat prompt's (one prompt)."""
    if body.use_beam_search:
        if images:
            raise APIError(400, "use_beam_search is not served with images", param="use_beam_search")
        check_beam_request(body, model)
        return BeamChoices(ctx, model, body, prompts, samplings, arrived)
    generations, prompt_index = [], []
    hook = ctx.finish_hook(model, body)
    for p, (ids, sampling) in enumerate(zip(prompts, samplings, strict=True)):
        ctx.metrics.observe_params(model.name, body.n, sampling.max_tokens)
        for j in range(body.n):
            seeded = msgspec.structs.replace(sampling, seed=choice_seed(sampling.seed, j))
            generations.append(engine_request(ctx, model, body, ids, seeded, arrived, on_finished=hook, images=images))
            prompt_index.append(p)
    return Choices(generations, prompt_index)


class EventStream(EventSourceResponse):
    """sse-starlette's response, less its per-event cancel scope when no send timeout is set
    (anyio looked up its backend for every token: ~7% of the gateway's CPU under load)."""

    async def _send_with_timeout(self, send, message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


async def _respond(choices: Choices, responder: Responder, body: _Sampling, request: Request,
                   usage_every_chunk: bool = False):
    # vLLM's continuous_usage_stats: the usage so far on every chunk (as the pipeline routes always do)
    usage_every_chunk = usage_every_chunk or bool(body.stream_options and body.stream_options.continuous_usage_stats)
    check_one_choice(body, choices)
    await choices.submit()
    request_id = f"{'chatcmpl' if responder.is_chat else 'cmpl'}-{choices.request_id}"
    created = int(time.time())
    with_metrics = request.app.state.ctx.server.per_request_metrics
    if body.stream:
        stream = _sse(choices, responder, request_id, created, body.include_usage, usage_every_chunk, with_metrics,
                      with_kv_transfer=body.kv_transfer_params is not None)
        return EventStream(stream, sep="\n")
    await collect(choices, responder, request)
    answer = responder.response(request_id, created, choices.usage())
    if with_metrics and (metrics := choices.request_metrics()) is not None:
        answer["metrics"] = metrics
    if body.kv_transfer_params is not None:
        answer["kv_transfer_params"] = await answer_params(choices)
    return JSONResponse(answer)


async def collect(choices: Choices, responder: Responder, request: Request) -> None:
    """Whole-response mode: gather every choice, abort if the client goes away meanwhile."""
    async def consume() -> None:
        async for index, delta in choices.deltas():
            responder.add(index, delta)

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
    except asyncio.CancelledError:  # the handler itself was cancelled (a Batch API line, say): abort too
        task.cancel()
        raise
    await task  # re-raises APIError or CancelledError


async def _sse(choices: Choices, responder: Responder, request_id: str, created: int, include_usage: bool,
               usage_every_chunk: bool, with_metrics: bool = False, with_kv_transfer: bool = False):
    """usage_every_chunk (the pipeline routes, as the seed product does): with include_usage, every
    chunk carries the usage so far, ttft and tps included; the final usage chunk still comes last.
    with_metrics: the final usage chunk carries vLLM's per-request metrics.
    with_kv_transfer: the chunk that finishes the choice carries its kv_transfer_params (vLLM's)."""
    def data(obj: dict) -> bytes:
        if include_usage and usage_every_chunk and "choices" in obj and "usage" not in obj:
            obj["usage"] = choices.usage().as_dict()
        return b"data: " + _json.encode(obj) + b"\n\n"  # one SSE event (msgspec's JSON has no newline)

    try:
        for first in responder.first_chunks(request_id, created):
            yield data(first)
        async for index, delta in choices.deltas():
            out = responder.chunks(request_id, created, index, delta)
            if with_kv_transfer and delta.finish_reason is not None and out:
                out[-1]["kv_transfer_params"] = await answer_params(choices)
            for c in out:
                yield data(c)
        if include_usage:
            last = responder.usage_chunk(request_id, created, choices.usage())
            if with_metrics and (metrics := choices.request_metrics()) is not None:
                last["metrics"] = metrics
            yield data(last)
    except APIError as exc:  # the stream has started: report in-band so clients raise, not hang
        yield data(exc.body())
    yield b"data: [DONE]\n\n"
