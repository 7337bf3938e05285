"""A chat answer whose prompt opens the thinking, in two engine requests: the thinking, cut at
`</think>` or at `thinking_token_budget` tokens, then the answer, which alone carries the request's
grammar (structured outputs, a forced tool call)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import msgspec

from services.api.openai.generation import Delta, FinishHook, Generation
from services.api.openai.reasoning import END
from shared.wire.messages import SamplingParams

CLOSE = "\n" + END + "\n\n"  # what a thinking cut by its budget is closed with, as Qwen3's guide does
MakeGeneration = Callable[[list[int], SamplingParams, list[str]], Generation]


class ThinkingGeneration:
    """Quacks as a Generation for choices.Choices: its stream is the thinking's until the answer's
    starts, and its token count covers both."""

    def __init__(self, make: MakeGeneration, prompt_ids: list[int], sampling: SamplingParams,
                 stop: list[str], budget: int | None, encode: Callable[[str], list[int]],
                 on_finished: FinishHook | None = None):
        self.make, self.prompt_ids, self.sampling, self.stop, self.encode = make, prompt_ids, sampling, stop, encode
        thinking = msgspec.structs.replace(sampling, guided=None,
                                           max_tokens=min(budget or sampling.max_tokens, sampling.max_tokens))
        self.first = make(prompt_ids, thinking, [END])
        self.first.keeps_output = True  # its token ids go on to the answer's prompt
        self.second: Generation | None = None
        self.on_finished = on_finished  # handed on to the request's last generation
        self.keeps_output = on_finished is not None

    @property
    def stream(self):
        return (self.second or self.first).stream

    @property
    def arrival(self) -> float:
        return self.first.arrival

    @property
    def first_token_at(self) -> float | None:
        return self.first.first_token_at

    @property
    def num_cached_tokens(self) -> int:
        return self.first.num_cached_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.first.num_output_tokens + (self.second.num_output_tokens if self.second else 0)

    def timings(self) -> dict[str, float] | None:
        return self.first.timings()

    async def submit(self) -> None:
        await self.first.submit()

    async def deltas(self) -> AsyncIterator[Delta]:
        closed = used = 0
        async for delta in self.first.deltas():
            if delta.finish_reason is None:
                yield delta
                continue
            closed = self.first.detokenizer.is_stopped  # it wrote `</think>` itself
            used = len(self.first.output_ids)
            if not closed and (delta.finish_reason != "length" or used >= self.sampling.max_tokens):
                self._pass_on(self.first)  # it ended while thinking (its end of sequence, or max_tokens):
                yield delta  # so does the answer
                return
            yield Delta(delta.text, None, delta.token_ids, delta.logprobs, delta.prompt_logprobs)
        close = END if closed else CLOSE
        yield Delta(close)  # the responder's reasoning parser sees the thinking end
        ids = self.prompt_ids + self.first.output_ids + ([] if closed else self.encode(CLOSE))
        answer = msgspec.structs.replace(self.sampling, max_tokens=self.sampling.max_tokens - used, prompt_logprobs=None)
        self.second = self.make(ids, answer, self.stop)
        self._pass_on(self.second)
        await self.second.submit()
        async for delta in self.second.deltas():
            yield delta

    def _pass_on(self, generation: Generation) -> None:
        """The inference log, if any, records the request's last generation."""
        generation.on_finished, generation.keeps_output = self.on_finished, self.keeps_output or generation.keeps_output
