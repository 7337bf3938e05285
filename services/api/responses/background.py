"""Background responses (`background: true`): answered after the POST returns, stored as they go,
and cancelled through `sy.v1.background.<id>.cancel`, which the gateway running one listens on."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import msgspec

from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.openai.choices import Choices
from services.api.openai.responder import ChatResponder
from services.api.responses.as_chat import ResponsesRequest, assistant_messages, output_items, response_object
from shared.log import get_logger
from shared.wire import subjects

log = get_logger("api")
_TASKS: set[asyncio.Task] = set()


def start(ctx: ApiContext, keep, load, choices: Choices, responder: ChatResponder, body: ResponsesRequest,
          response_id: str, conversation: list[dict], created_at: int) -> None:
    """keep(response, conversation) stores the response; load() reads its stored record (a cancel
    that found no one listening, from another gateway before this one subscribed, is stored there)."""
    task = asyncio.get_running_loop().create_task(
        _run(ctx, keep, load, choices, responder, body, response_id, conversation, created_at))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _run(ctx: ApiContext, keep, load, choices: Choices, responder: ChatResponder, body: ResponsesRequest,
               response_id: str, conversation: list[dict], created_at: int) -> None:
    me = asyncio.current_task()
    cancels = []  # the cancel requests, answered once the cancelled response is stored
    generating = False  # a cancel heard meanwhile interrupts the task; later ones are just answered

    async def on_cancel(msg) -> None:
        cancels.append(msg)
        if generating and len(cancels) == 1:
            me.cancel()

    def answer(status: str, error: dict | None = None) -> dict:
        choice = responder.choices[0]
        text = "".join(choice.text)
        items = output_items(text, choice.tool_calls, choice.logprobs, "".join(choice.reasoning))
        response = response_object(response_id, body, items, status,
                                   choices.usage(), choice.finish_reason if status == "completed" else None,
                                   created_at=created_at)
        response["error"] = error
        return response

    ctx.server.num_in_flight += 1  # a drain waits for it, as for any request
    sub = await ctx.nc.subscribe(subjects.background_cancel(response_id), cb=on_cancel)
    async def stored_cancelled() -> bool:
        record = await load()
        return record is not None and record["response"]["status"] == "cancelled"

    def check() -> None:
        """A cancel heard raises here too: Python 3.11's wait_for (inside nats-py's requests) can
        drop a task's cancellation when its awaited reply lands in the same loop iteration."""
        if cancels:
            raise asyncio.CancelledError

    final = answer("queued")
    generating = True
    try:
        if await stored_cancelled():
            raise asyncio.CancelledError
        await choices.submit()
        check()
        await keep(response_object(response_id, body, [], "in_progress", None, created_at=created_at), conversation)
        check()
        async with aclosing(choices.deltas()) as deltas:
            async for index, delta in deltas:
                check()
                responder.add(index, delta)
        final = answer("completed")
    except APIError as exc:
        error = exc.body()["error"]
        final = answer("failed", {"code": error.get("code") or "server_error", "message": error["message"]})
    except asyncio.CancelledError:
        await asyncio.shield(choices.abort())
        cancelled = bool(cancels) or await stored_cancelled()
        final = answer("cancelled" if cancelled else "failed",
                       None if cancelled else {"code": "server_error", "message": "the gateway stopped"})
    except Exception as exc:  # a bug: the response says so rather than staying in_progress
        log.exception("background_response_failed", response_id=response_id)
        final = answer("failed", {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"})
    finally:
        generating = False
        ctx.server.num_in_flight -= 1
    try:
        if final["status"] != "cancelled" and await stored_cancelled():
            final = answer("cancelled")  # cancelled meanwhile where no one heard: the client was told so
        choice = responder.choices[0]
        await asyncio.shield(keep(final, conversation + assistant_messages("".join(choice.text), choice.tool_calls)))
    finally:
        await sub.unsubscribe()
    for msg in cancels:
        await msg.respond(msgspec.json.encode(final))
