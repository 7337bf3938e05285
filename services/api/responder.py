"""Turns choices' deltas into OpenAI bodies: one whole response, or the chunks of a stream.

A responder keeps each choice's text, finish reason and logprobs as deltas arrive; the
completions flavour also echoes the prompt (with its logprobs) when asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.api import openai_format as fmt
from services.api.context import ServedModel
from services.api.generation import Delta
from services.api.logprobs_format import CompletionLogprobs, chat_logprobs
from services.api.openai_format import Usage
from services.api.protocol import ChatCompletionRequest, CompletionRequest


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | list[dict] | None = None
    has_started: bool = False


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
                choice.logprobs = CompletionLogprobs(model.tokenizer)

    def _prompt_text(self, p: int) -> str:
        prompt = self.body.prompt
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[p], str):
            return prompt[p]
        return self.model.tokenizer.decode(self.prompts[p], skip_special_tokens=False)

    def add(self, index: int, delta: Delta) -> tuple[str, dict | None]:
        choice = self.choices[index]
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
        choice.text.append(text)
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        return text, logprobs

    def chunks(self, request_id: str, created: int, index: int, delta: Delta) -> list[dict]:
        text, logprobs = self.add(index, delta)
        return [fmt.chunk(request_id, created, self.model.name, False,
                          [fmt.completion_choice(index, text, delta.finish_reason, logprobs)])]

    def response(self, request_id: str, created: int, usage: Usage) -> dict:
        choices = [fmt.completion_choice(i, "".join(c.text), c.finish_reason,
                                         c.logprobs.as_dict() if c.logprobs is not None else None)
                   for i, c in enumerate(self.choices)]
        return fmt.response(request_id, created, self.model.name, False, choices, usage)


class ChatResponder(Responder):
    is_chat = True

    def __init__(self, model: ServedModel, body: ChatCompletionRequest, num_choices: int):
        super().__init__(model, num_choices)
        self.wants_logprobs = body.logprobs
        if body.logprobs:
            for choice in self.choices:
                choice.logprobs = []

    def first_chunks(self, request_id: str, created: int) -> list[dict]:
        return [fmt.chunk(request_id, created, self.model.name, True,
                          [fmt.chat_delta_choice(i, {"role": "assistant", "content": ""}, None, None)])
                for i in range(len(self.choices))]

    def add(self, index: int, delta: Delta) -> list[dict] | None:
        choice = self.choices[index]
        logprobs = None
        if self.wants_logprobs and delta.logprobs:
            logprobs = chat_logprobs(self.model.tokenizer, delta.token_ids, delta.logprobs)
            choice.logprobs.extend(logprobs)
        choice.text.append(delta.text)
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        return logprobs

    def chunks(self, request_id: str, created: int, index: int, delta: Delta) -> list[dict]:
        logprobs = self.add(index, delta)
        out = []
        if delta.text or logprobs:
            out.append(fmt.chunk(request_id, created, self.model.name, True,
                                 [fmt.chat_delta_choice(index, {"content": delta.text}, None, logprobs)]))
        if delta.finish_reason:
            out.append(fmt.chunk(request_id, created, self.model.name, True,
                                 [fmt.chat_delta_choice(index, {}, delta.finish_reason, None)]))
        return out

    def response(self, request_id: str, created: int, usage: Usage) -> dict:
        choices = [fmt.chat_choice(i, "".join(c.text), c.finish_reason, c.logprobs) for i, c in enumerate(self.choices)]
        return fmt.response(request_id, created, self.model.name, True, choices, usage)
