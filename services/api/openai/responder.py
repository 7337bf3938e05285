"""Turns choices' deltas into OpenAI bodies: one whole response, or the chunks of a stream.

A responder keeps each choice's text, finish reason and logprobs as deltas arrive; the
completions flavour also echoes the prompt (with its logprobs) when asked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.api.context import ServedModel
from services.api.openai import format as fmt
from services.api.openai.format import Usage
from services.api.openai.generation import Delta
from services.api.openai.logprobs_format import CompletionLogprobs, chat_logprobs, prompt_logprobs
from services.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.api.openai.reasoning import ReasoningSplitter
from services.api.openai.tools.choice import ToolPlan
from services.api.openai.tools.parsers import parser_for


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | list[dict] | None = None
    has_started: bool = False
    tool_calls: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None  # vLLM's shape, when the request asked
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    reasoning: list[str] = field(default_factory=list)  # a reasoning parser's share of the text
    token_ids: list[int] = field(default_factory=list)  # every token it generated (return_token_ids)


class Responder:
    is_chat = False

    def __init__(self, model: ServedModel, num_choices: int):
        self.model = model
        self.choices = [_Choice() for _ in range(num_choices)]

    def add(self, index: int, delta: Delta):
        """Record a delta in its choice; returns what a stream chunk of it carries."""
        raise NotImplementedError

    def chunks(self, request_id: str, created: int, index: int, delta: Delta) -> list[dict]:
        raise NotImplementedError

    def first_chunks(self, request_id: str, created: int) -> list[dict]:
        return []

    def usage_chunk(self, request_id: str, created: int, usage: Usage) -> dict:
        return fmt.chunk(request_id, created, self.model.name, self.is_chat, [], usage)

    def response(self, request_id: str, created: int, usage: Usage) -> dict:
        raise NotImplementedError


class CompletionResponder(Responder):
    def __init__(self, model: ServedModel, body: CompletionRequest, prompts: list[list[int]], num_choices: int):
        super().__init__(model, num_choices)
        self.body = body
        self.prompts = prompts
        n = body.n
        self.prompt_of = [i // n for i in range(num_choices)]
        if body.logprobs is not None:
            for choice in self.choices:
                choice.logprobs = CompletionLogprobs(model.tokenizer, as_token_ids=body.return_tokens_as_token_ids)

    def _prompt_text(self, p: int) -> str:
        prompt = self.body.prompt
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[p], str):
            return prompt[p]
        return self.model.tokenizer.decode(self.prompts[p], skip_special_tokens=False)

    def add(self, index: int, delta: Delta) -> tuple[str, dict | None]:
        choice = self.choices[index]
        choice.token_ids.extend(delta.token_ids)
        text, logprobs = delta.text, None
        if not choice.has_started:
            choice.has_started = True
            if self.body.echo:
                text = self._prompt_text(self.prompt_of[index]) + text
        if choice.logprobs is not None:
            parts = []
            if self.body.echo and delta.prompt_logprobs is not None:
                parts.append(choice.logprobs.add(self.prompts[self.prompt_of[index]], delta.prompt_logprobs))
            parts.append(choice.logprobs.add(delta.token_ids, delta.logprobs or [None] * len(delta.token_ids)))
            logprobs = {k: [x for part in parts for x in part[k]] for k in parts[0]}
        if self.body.prompt_logprobs is not None and delta.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs(self.model.tokenizer, self.prompts[self.prompt_of[index]],
                                                     delta.prompt_logprobs, self.body.return_tokens_as_token_ids)
        choice.text.append(text)
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        choice.stop_reason = delta.stop_reason if delta.stop_reason is not None else choice.stop_reason
        return text, logprobs

    def chunks(self, request_id: str, created: int, index: int, delta: Delta) -> list[dict]:
        is_first = not self.choices[index].has_started
        text, logprobs = self.add(index, delta)
        choice = fmt.completion_choice(index, text, delta.finish_reason, logprobs, delta.stop_reason)
        if self.body.return_token_ids:  # vLLM's: the prompt's ids on a choice's first chunk, then each delta's
            if is_first:
                choice["prompt_token_ids"] = self.prompts[self.prompt_of[index]]
            choice["token_ids"] = list(delta.token_ids)
        return [fmt.chunk(request_id, created, self.model.name, False, [choice])]

    def response(self, request_id: str, created: int, usage: Usage) -> dict:
        choices = [fmt.completion_choice(i, "".join(c.text), c.finish_reason,
                                         c.logprobs.as_dict() if c.logprobs is not None else None, c.stop_reason)
                   for i, c in enumerate(self.choices)]
        asked = bool(self.body.return_token_ids)
        for i, (choice, c) in enumerate(zip(choices, self.choices, strict=True)):
            choice["prompt_logprobs"] = c.prompt_logprobs  # null unless asked, as vLLM sends it
            choice["prompt_token_ids"] = self.prompts[self.prompt_of[i]] if asked else None
            choice["token_ids"] = c.token_ids if asked else None
        return fmt.response(request_id, created, self.model.name, False, choices, usage)


class ChatResponder(Responder):
    """With tools, each choice's text goes through the tool-call parser: calls leave the content and
    become `tool_calls` (streamed as OpenAI streams them: id and name first, then the arguments),
    and an answer that called a tool finishes with "tool_calls"."""

    is_chat = True

    def __init__(self, model: ServedModel, body: ChatCompletionRequest, num_choices: int,
                 tools: ToolPlan | None = None, prompt_ids: list[int] | None = None,
                 reasoning: Callable[[], ReasoningSplitter] | None = None):
        """reasoning: a splitter per choice (--reasoning-parser); its content goes on to the tool parser."""
        super().__init__(model, num_choices)
        self.splitters = [reasoning() for _ in range(num_choices)] if reasoning else None
        self.include_reasoning = body.include_reasoning  # vLLM's: false drops the thinking from the answer
        self.prompt_ids = prompt_ids or []
        self.wants_prompt_logprobs = body.prompt_logprobs is not None
        self.wants_logprobs = body.logprobs
        self.as_token_ids = body.return_tokens_as_token_ids
        self.wants_token_ids = bool(body.return_token_ids)
        last = body.messages[-1]
        self.echo = last.text() if body.echo and last.role == "assistant" else ""  # vLLM's chat echo
        self.unsent_ids: list[list[int]] = [[] for _ in range(num_choices)]  # ids no chunk has carried yet
        if body.logprobs:
            for choice in self.choices:
                choice.logprobs = []
        self.parsers = [parser_for(tools.parser, tools.accepts) for _ in range(num_choices)] if tools else None
        self.is_forced = bool(tools and tools.is_forced)

    def first_chunks(self, request_id: str, created: int) -> list[dict]:
        first = [fmt.chunk(request_id, created, self.model.name, True,
                           [fmt.chat_delta_choice(i, {"role": "assistant", "content": ""}, None, None)])
                 for i in range(len(self.choices))]
        if self.wants_token_ids:  # vLLM's: the prompt's ids once, on the first chunk only
            first[0]["prompt_token_ids"] = self.prompt_ids
        if self.echo:
            first += [fmt.chunk(request_id, created, self.model.name, True,
                                [fmt.chat_delta_choice(i, {"content": self.echo}, None, None)])
                      for i in range(len(self.choices))]
        return first

    def add(self, index: int, delta: Delta) -> tuple[list[dict] | None, str, list[dict], str]:
        """-> (logprobs, content, tool calls, reasoning) this delta adds to its choice."""
        choice = self.choices[index]
        choice.token_ids.extend(delta.token_ids)
        logprobs = None
        if self.wants_logprobs and delta.logprobs:
            logprobs = chat_logprobs(self.model.tokenizer, delta.token_ids, delta.logprobs, self.as_token_ids)
            choice.logprobs.extend(logprobs)
        if self.wants_prompt_logprobs and delta.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs(self.model.tokenizer, self.prompt_ids, delta.prompt_logprobs,
                                                     self.as_token_ids)
        content, calls, reasoning = delta.text, [], ""
        if self.splitters is not None:
            reasoning, content = self.splitters[index].feed(delta.text)
            if delta.finish_reason:
                more_reasoning, more_content = self.splitters[index].finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
            if not self.include_reasoning:
                reasoning = ""
            choice.reasoning.append(reasoning)
        if self.parsers is not None:
            content, calls = self.parsers[index].feed(content)
            if delta.finish_reason:
                rest, more = self.parsers[index].finish()
                # a forced answer is all call syntax: a call cut short (max_tokens) is not content
                content, calls = content + ("" if self.is_forced else rest), calls + more
        choice.text.append(content)
        choice.tool_calls.extend(calls)
        choice.stop_reason = delta.stop_reason if delta.stop_reason is not None else choice.stop_reason
        if delta.finish_reason:
            choice.finish_reason = "tool_calls" if delta.finish_reason == "stop" and choice.tool_calls \
                else delta.finish_reason
        return logprobs, content, calls, reasoning

    def chunks(self, request_id: str, created: int, index: int, delta: Delta) -> list[dict]:
        logprobs, content, calls, reasoning = self.add(index, delta)

        def chunk(body: dict, finish_reason: str | None = None, logprobs_=None) -> dict:
            stop_reason = self.choices[index].stop_reason if finish_reason else None
            return fmt.chunk(request_id, created, self.model.name, True,
                             [fmt.chat_delta_choice(index, body, finish_reason, logprobs_, stop_reason)])

        # the finish reason rides on the last content chunk (as vLLM and the product send it), or
        # on a chunk of its own after tool calls or when the last token had no text
        last = delta.finish_reason is not None and not calls
        out = [chunk({"content": content}, self.choices[index].finish_reason if last else None, logprobs)] \
            if content or logprobs else []
        first = len(self.choices[index].tool_calls) - len(calls)
        for k, call in enumerate(calls, start=first):
            fn = call["function"]
            out.append(chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                              "function": {"name": fn["name"], "arguments": ""}}]}))
            out.append(chunk({"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]}))
        if delta.finish_reason and not (last and out):
            out.append(chunk({}, self.choices[index].finish_reason))
        out = ([chunk({"reasoning": reasoning, "reasoning_content": reasoning})] if reasoning else []) + out
        if self.wants_token_ids:  # the delta's ids ride on its first chunk, or on a later one where it has none
            self.unsent_ids[index].extend(delta.token_ids)
            if out:
                out[0]["choices"][0]["token_ids"], self.unsent_ids[index] = self.unsent_ids[index], []
        return out

    def response(self, request_id: str, created: int, usage: Usage) -> dict:
        choices = [fmt.chat_choice(i, self.echo + "".join(c.text), c.finish_reason, c.logprobs, c.tool_calls,
                                   c.stop_reason,
                                   "".join(c.reasoning) or None)
                   for i, c in enumerate(self.choices)]
        for choice, c in zip(choices, self.choices, strict=True):
            choice["token_ids"] = c.token_ids if self.wants_token_ids else None
        body = fmt.response(request_id, created, self.model.name, True, choices, usage)
        body["prompt_logprobs"] = self.choices[0].prompt_logprobs  # vLLM's: once, at the top; null unless asked
        body["prompt_token_ids"] = self.prompt_ids if self.wants_token_ids else None
        return body
