"""POST /v1/responses (whole, or streamed as the Responses API's events) and GET /v1/responses/{id}."""

from __future__ import annotations

import itertools
import re
import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.guards import arrival
from services.api.off_loop import off_loop
from services.api.openai.body import parse, validate
from services.api.openai.choices import Choices
from services.api.openai.protocol import ChatCompletionRequest
from services.api.openai.responder import ChatResponder
from services.api.openai.routes import EventStream, chat_generation, collect
from services.api.responses import background
from services.api.responses.as_chat import (
    ResponsesRequest,
    assistant_messages,
    chat_body,
    function_call_item,
    input_messages,
    message_item,
    new_id,
    output_items,
    reasoning_item,
    response_object,
)
from services.api.responses.store import ResponseStore
from shared import subjects

router = APIRouter()
CANCEL_TIMEOUT_S = 10.0
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")
_json = msgspec.json.Encoder()


def _store(ctx: ApiContext) -> ResponseStore:
    if ctx.responses is None:
        ctx.responses = ResponseStore(ctx.nc)
    return ctx.responses


async def _stored(ctx: ApiContext, response_id: str, param: str | None = None) -> dict:
    record = await _store(ctx).get(response_id) if RESPONSE_ID.match(response_id) else None
    if record is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")
    return record


@router.post("/v1/responses")
async def create_response(request: Request):
    ctx, model, body = await parse(request, ResponsesRequest)
    conversation = []
    if body.previous_response_id is not None:
        conversation = (await _stored(ctx, body.previous_response_id, "previous_response_id"))["conversation"]
    conversation = conversation + input_messages(body.input)
    chat = validate(ChatCompletionRequest, chat_body(body, conversation), model.openai.chat)
    choices, responder = await off_loop(chat_generation, ctx, model, chat, arrival(request))
    response_id = new_id("resp")
    if body.background:
        queued = response_object(response_id, body, [], "queued", None)
        await _keep(ctx, body, queued, conversation)
        background.start(ctx, lambda response, history: _keep(ctx, body, response, history),
                         lambda: _store(ctx).get(response_id), choices, responder, body, response_id, conversation,
                         queued["created_at"])
        return JSONResponse(queued)
    await choices.submit()
    if body.stream:
        return EventStream(_events(ctx, choices, responder, body, response_id, conversation), sep="\n")
    await collect(choices, responder, request)
    choice = responder.choices[0]
    text = "".join(choice.text)
    items = output_items(text, choice.tool_calls, choice.logprobs, "".join(choice.reasoning))
    response = response_object(response_id, body, items, "completed",
                               choices.usage(), choice.finish_reason)
    await _keep(ctx, body, response, conversation + assistant_messages(text, choice.tool_calls))
    return JSONResponse(response)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str):
    return JSONResponse((await _stored(request.app.state.ctx, response_id))["response"])


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str):
    """A background response still running is cancelled by the gateway running it (output so far
    kept); one already finished is returned as it is."""
    ctx: ApiContext = request.app.state.ctx
    record = await _stored(ctx, response_id)
    response = record["response"]
    if not response.get("background"):
        raise APIError(400, "Cannot cancel a synchronous response.", param="response_id", code="not_background")
    if response["status"] not in ("queued", "in_progress"):
        return JSONResponse(response)
    try:
        msg = await ctx.nc.request(subjects.background_cancel(response_id), b"", timeout=CANCEL_TIMEOUT_S)
        return JSONResponse(msgspec.json.decode(msg.data))
    except NoRespondersError:  # the gateway that ran it stopped, or it finished just now
        record = await _stored(ctx, response_id)
        response = record["response"]
        if response["status"] in ("queued", "in_progress"):
            response["status"] = "cancelled"
            await _store(ctx).put(response_id, {**record, "response": response})
        return JSONResponse(response)
    except (TimeoutError, NatsTimeoutError):
        raise APIError(503, "the gateway running this response did not answer; try again",
                       param="response_id", code="busy") from None


async def _keep(ctx: ApiContext, body: ResponsesRequest, response: dict, conversation: list[dict]) -> None:
    if body.store:
        response["store"] = await _store(ctx).put(response["id"], {"response": response, "conversation": conversation})


async def _events(ctx: ApiContext, choices: Choices, responder: ChatResponder, body: ResponsesRequest,
                  response_id: str, conversation: list[dict]):
    """created, in_progress; per output item: added, its deltas, done; completed (or error)."""
    numbers = itertools.count()
    created = int(time.time())
    output: list[dict] = []
    text_id, texts, text_logprobs = None, [], []
    reasoning_id, thoughts = None, []

    def event(kind: str, **fields) -> bytes:
        data = _json.encode({"type": kind, "sequence_number": next(numbers), **fields})
        return f"event: {kind}\ndata: ".encode() + data + b"\n\n"

    def close_text() -> list[bytes]:
        text, index = "".join(texts), len(output)
        item = message_item(text_id, text, "completed", text_logprobs)
        output.append(item)
        return [event("response.output_text.done", item_id=text_id, output_index=index, content_index=0, text=text,
                      logprobs=text_logprobs),
                event("response.content_part.done", item_id=text_id, output_index=index, content_index=0,
                      part=item["content"][0]),
                event("response.output_item.done", output_index=index, item=item)]

    def close_reasoning() -> list[bytes]:
        text, index = "".join(thoughts), len(output)
        item = reasoning_item(reasoning_id, text, "completed")
        output.append(item)
        return [event("response.reasoning_text.done", item_id=reasoning_id, output_index=index, content_index=0,
                      text=text),
                event("response.output_item.done", output_index=index, item=item)]

    started = response_object(response_id, body, [], "in_progress", None, created_at=created)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    try:
        async for index, delta in choices.deltas():
            logprobs, content, calls, reasoning = responder.add(index, delta)
            if reasoning:  # the thinking streams as a reasoning item of its own, before the answer's
                if reasoning_id is None:
                    reasoning_id, thoughts = new_id("rs"), []
                    yield event("response.output_item.added", output_index=len(output),
                                item=reasoning_item(reasoning_id, "", "in_progress"))
                thoughts.append(reasoning)
                yield event("response.reasoning_text.delta", item_id=reasoning_id, output_index=len(output),
                            content_index=0, delta=reasoning)
            if reasoning_id is not None and (content or calls or delta.finish_reason):
                for e in close_reasoning():
                    yield e
                reasoning_id = None
            if content:
                if text_id is None:
                    text_id, texts, text_logprobs = new_id("msg"), [], []
                    yield event("response.output_item.added", output_index=len(output),
                                item=message_item(text_id, "", "in_progress"))
                    yield event("response.content_part.added", item_id=text_id, output_index=len(output),
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                texts.append(content)
                text_logprobs.extend(logprobs or [])
                yield event("response.output_text.delta", item_id=text_id, output_index=len(output), content_index=0,
                            delta=content, logprobs=logprobs or [])
            for call in calls:
                if text_id is not None:
                    for e in close_text():
                        yield e
                    text_id = None
                item, k = function_call_item(call, "completed"), len(output)
                yield event("response.output_item.added", output_index=k, item=function_call_item(call, "in_progress"))
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                            name=item["name"], arguments=item["arguments"])
                output.append(item)
                yield event("response.output_item.done", output_index=k, item=item)
        if text_id is not None:
            for e in close_text():
                yield e
        choice = responder.choices[0]
        response = response_object(response_id, body, output, "completed", choices.usage(), choice.finish_reason,
                                   created_at=created)
        await _keep(ctx, body, response, conversation + assistant_messages("".join(choice.text), choice.tool_calls))
        yield event("response.completed", response=response)
    except APIError as exc:  # the stream has started: the error goes in-band
        error = exc.body()["error"]
        yield event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
