"""POST /v1/responses (whole, or streamed as the Responses API's events) and GET /v1/responses/{id}."""

from __future__ import annotations

import re

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.guards import arrival
from services.api.media.prompt import store_images
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
    input_messages,
    new_id,
    output_items,
    response_object,
)
from services.api.responses.events import ResponseEvents
from services.api.responses.store import ResponseStore
from shared.wire import subjects

router = APIRouter()
CANCEL_TIMEOUT_S = 10.0
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


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
    images = await store_images(ctx, model, chat.messages)
    choices, responder = await off_loop(chat_generation, ctx, model, chat, arrival(request), images)
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
    writer = ResponseEvents(response_id, body)
    for event in writer.start():
        yield event
    try:
        async for index, delta in choices.deltas():
            for event in writer.add(*responder.add(index, delta), finished=bool(delta.finish_reason)):
                yield event
        choice = responder.choices[0]
        response, closing = writer.finish(choices.usage(), choice.finish_reason)
        for event in closing:
            yield event
        await _keep(ctx, body, response, conversation + assistant_messages("".join(choice.text), choice.tool_calls))
        yield writer.completed(response)
    except APIError as exc:
        yield writer.error(exc)
