"""A streamed response as the Responses API's events: created, in_progress; per output item:
added, its deltas, done; completed (or error). The writer keeps which items are open."""

from __future__ import annotations

import itertools
import time

import msgspec

from services.api.errors import APIError
from services.api.responses.as_chat import (
    ResponsesRequest,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    response_object,
)

_json = msgspec.json.Encoder()


class ResponseEvents:
    def __init__(self, response_id: str, body: ResponsesRequest):
        self.response_id, self.body = response_id, body
        self.created = int(time.time())
        self.output: list[dict] = []  # the items done so far
        self._numbers = itertools.count()
        self._text_id: str | None = None  # the message item open, its texts and logprobs
        self._texts: list[str] = []
        self._text_logprobs: list = []
        self._reasoning_id: str | None = None  # the reasoning item open, and its thoughts
        self._thoughts: list[str] = []

    def event(self, kind: str, **fields) -> bytes:
        data = _json.encode({"type": kind, "sequence_number": next(self._numbers), **fields})
        return f"event: {kind}\ndata: ".encode() + data + b"\n\n"

    def start(self) -> list[bytes]:
        started = response_object(self.response_id, self.body, [], "in_progress", None, created_at=self.created)
        return [self.event("response.created", response=started), self.event("response.in_progress", response=started)]

    def add(self, logprobs, content: str, calls: list, reasoning: str, finished: bool) -> list[bytes]:
        """One delta as the responder split it: the thinking streams as a reasoning item of its own,
        before the answer's message item; each tool call is an item, whole."""
        events = []
        if reasoning:
            if self._reasoning_id is None:
                self._reasoning_id, self._thoughts = new_id("rs"), []
                events.append(self.event("response.output_item.added", output_index=len(self.output),
                                         item=reasoning_item(self._reasoning_id, "", "in_progress")))
            self._thoughts.append(reasoning)
            events.append(self.event("response.reasoning_text.delta", item_id=self._reasoning_id,
                                     output_index=len(self.output), content_index=0, delta=reasoning))
        if self._reasoning_id is not None and (content or calls or finished):
            events += self._close_reasoning()
        if content:
            events += self._text(content, logprobs or [])
        for call in calls:
            events += self._close_text() + self._call(call)
        return events

    def finish(self, usage, finish_reason: str | None) -> tuple[dict, list[bytes]]:
        """The completed response object, and the events that close what is still open."""
        events = self._close_text()
        return response_object(self.response_id, self.body, self.output, "completed", usage, finish_reason,
                               created_at=self.created), events

    def completed(self, response: dict) -> bytes:
        return self.event("response.completed", response=response)

    def error(self, exc: APIError) -> bytes:
        """The stream has started: an error goes in-band."""
        error = exc.body()["error"]
        return self.event("error", code=error.get("code"), message=error["message"], param=error.get("param"))

    def _text(self, content: str, logprobs: list) -> list[bytes]:
        events = []
        if self._text_id is None:
            self._text_id, self._texts, self._text_logprobs = new_id("msg"), [], []
            events += [self.event("response.output_item.added", output_index=len(self.output),
                                  item=message_item(self._text_id, "", "in_progress")),
                       self.event("response.content_part.added", item_id=self._text_id, output_index=len(self.output),
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
        self._texts.append(content)
        self._text_logprobs.extend(logprobs)
        events.append(self.event("response.output_text.delta", item_id=self._text_id, output_index=len(self.output),
                                 content_index=0, delta=content, logprobs=logprobs))
        return events

    def _close_text(self) -> list[bytes]:
        if self._text_id is None:
            return []
        text, index, item_id = "".join(self._texts), len(self.output), self._text_id
        item = message_item(item_id, text, "completed", self._text_logprobs)
        self.output.append(item)
        self._text_id = None
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=self._text_logprobs),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=item["content"][0]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _close_reasoning(self) -> list[bytes]:
        text, index, item_id = "".join(self._thoughts), len(self.output), self._reasoning_id
        item = reasoning_item(item_id, text, "completed")
        self.output.append(item)
        self._reasoning_id = None
        return [self.event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call) -> list[bytes]:
        item, k = function_call_item(call, "completed"), len(self.output)
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=k, item=function_call_item(call, "in_progress")),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                           delta=item["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=k, item=item)]
