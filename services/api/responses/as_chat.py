"""The Responses API as a chat underneath: its request becomes chat messages (instructions, the
stored conversation of previous_response_id, input items), and the chat's answer becomes
Response output items (a message with output_text, function_call items)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field

from services.api.errors import APIError
from services.api.openai.format import Usage
from services.api.openai.protocol import _Request


class FunctionTool(_Request):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # kept with the response and returned with it
    user: str | None = None
    background: bool = False  # answered after the POST returns (background.py); needs store
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)  # as on the chat route (vLLM's extension)
    include: list[Literal["message.output_text.logprobs"]] | None = None  # the only include with an effect here
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


_TEXT_PARTS = ("input_text", "output_text", "text")


def _content(content, where: str) -> str | list[dict]:
    """A message's content as the chat route takes it: its text, or (with an `input_image`) its
    parts in order, each image as chat's `image_url` part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise APIError(400, f"{where}.content must be text or a list of content parts", param="input")
    for j, part in enumerate(content):
        if part.get("type") not in (*_TEXT_PARTS, "input_image"):
            raise APIError(400, f"{where}.content[{j}].type {part.get('type')!r} is not supported: "
                                "input_text, output_text and input_image are", param="input")
        if part["type"] == "input_image" and not isinstance(part.get("image_url"), str):
            raise APIError(400, f"{where}.content[{j}] needs an image_url (a data URL or an http(s) one); "
                                "file_id images are not served", param="input")
    if not any(part["type"] == "input_image" for part in content):
        return "".join(part.get("text", "") for part in content)
    return [{"type": "text", "text": part.get("text", "")} if part["type"] in _TEXT_PARTS else
            {"type": "image_url", "image_url": {"url": part["image_url"], "detail": part.get("detail")}}
            for part in content]


def input_messages(items: str | list[dict]) -> list[dict]:
    """Input items -> chat messages; consecutive function_call items become one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"input[{i}].role must be user, assistant, system or developer", param="input")
            messages.append({"role": item["role"], "content": _content(item.get("content", ""), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": str(item.get("output", ""))})
        else:
            raise APIError(400, f"input[{i}].type {kind!r} is not supported: message, function_call and "
                                "function_call_output are", param="input")
    return messages


def chat_body(body: ResponsesRequest, conversation: list[dict]) -> dict:
    """The chat completion request that answers this response."""
    if body.background and not body.store:
        raise APIError(400, "background can only be used when `store` is true", param="background")
    if body.background and body.stream:
        raise APIError(400, "a background response cannot be streamed here; poll GET /v1/responses/{id}",
                       param="stream")
    chat: dict[str, Any] = {"model": body.model, "messages": conversation, "parallel_tool_calls": body.parallel_tool_calls}
    if body.instructions:
        chat["messages"] = [{"role": "system", "content": body.instructions}, *conversation]
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in body.tools]
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                          "schema": fmt.schema_ or {}}}
    elif fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    if body.top_logprobs is not None or "message.output_text.logprobs" in (body.include or []):
        chat["logprobs"], chat["top_logprobs"] = True, body.top_logprobs or 0
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("user", "user"), ("priority", "priority")):
        if getattr(body, ours) is not None:
            chat[theirs] = getattr(body, ours)
    return chat


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(text: str, tool_calls: list[dict], logprobs: list[dict] | None = None,
                 reasoning: str = "") -> list[dict]:
    """reasoning: the thinking a reasoning parser took out, as a reasoning item before the answer."""
    items = [reasoning_item(new_id("rs"), reasoning, "completed")] if reasoning else []
    if text:
        items.append(message_item(new_id("msg"), text, "completed", logprobs))
    items += [function_call_item(call, "completed") for call in tool_calls]
    return items


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(item_id: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    """logprobs: chat's logprobs.content entries (the same shape), when the request included them."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}] if text or
            status == "completed" else []}


def function_call_item(call: dict, status: str) -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if status == "completed" else "", "status": status}


def response_object(response_id: str, body: ResponsesRequest, output: list[dict], status: str,
                    usage: Usage | None, finish_reason: str | None = None, created_at: int | None = None) -> dict:
    """The Response, as the openai SDK reads it."""
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
        else {"type": "text"}
    tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) \
        else (body.tool_choice or "auto")
    return {
        "id": response_id, "object": "response", "created_at": created_at or int(time.time()), "model": body.model,
        "status": "incomplete" if incomplete and status == "completed" else status, "output": output,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls,
        "tool_choice": tool_choice, "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "text": {"format": fmt}, "previous_response_id": body.previous_response_id, "store": body.store,
        "metadata": body.metadata or {}, "error": None, "incomplete_details": incomplete,
        "background": body.background, "top_logprobs": body.top_logprobs,
        "usage": None if usage is None else {
            "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}},
    }


def assistant_messages(text: str, tool_calls: list[dict]) -> list[dict]:
    """The answer as chat history for a later previous_response_id."""
    if not text and not tool_calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return [message]
