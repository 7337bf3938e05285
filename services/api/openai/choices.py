"""All the choices of one OpenAI request: `n` per prompt, each its own engine request.

Choice index = prompt index * n + j, as vLLM numbers them. The choices run concurrently; their
deltas are merged into one stream in arrival order. If one fails, the others are aborted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from services.api.openai.format import Usage
from services.api.openai.generation import Delta, Generation


class Choices:
    def __init__(self, generations: list[Generation], prompt_index: list[int]):
        self.generations = generations
        self.prompt_index = prompt_index  # of each choice
        self.arrival = min((g.arrival for g in generations), default=time.monotonic())

    async def submit(self) -> None:
        """All or nothing: if one is refused, those already accepted are aborted."""
        for i, gen in enumerate(self.generations):
            try:
                await gen.submit()
            except Exception:
                for accepted in self.generations[:i]:
                    await accepted.stream.abort()
                raise

    async def abort(self) -> None:
        """The engine lets go of every accepted choice that has not finished."""
        for gen in self.generations:
            if gen.stream is not None:
                await gen.stream.abort()

    @property
    def num_choices(self) -> int:
        return len(self.generations)

    @property
    def request_id(self) -> str:
        return self.generations[0].stream.request_id

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) as they arrive; ends when every choice has finished."""
        if len(self.generations) == 1:  # the common case needs no tasks
            async for delta in self.generations[0].deltas():
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, gen: Generation) -> None:
            try:
                async for delta in gen.deltas():
                    queue.put_nowait((index, delta))
                queue.put_nowait((index, done))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.generations)]
        try:
            num_open = len(tasks)
            while num_open:
                index, item = await queue.get()
                if item is done:
                    num_open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def request_metrics(self) -> dict[str, float] | None:
        """vLLM's per-request metrics, for a request of one choice (vLLM leaves them out for n > 1)."""
        if len(self.generations) != 1 or not isinstance(self.generations[0], Generation):
            return None
        return self.generations[0].request_metrics()

    def usage(self) -> Usage:
        """Prompt tokens count once per prompt; completion tokens add up over every choice."""
        now = time.monotonic()
        firsts = {}
        for gen, p in zip(self.generations, self.prompt_index, strict=True):
            firsts.setdefault(p, gen)
        completion = sum(g.num_output_tokens for g in self.generations)
        first_token = min((g.first_token_at for g in self.generations if g.first_token_at), default=now)
        return Usage(prompt_tokens=sum(len(g.prompt_ids) for g in firsts.values()), completion_tokens=completion,
                     cached_tokens=sum(g.num_cached_tokens for g in firsts.values()),
                     ttft=first_token - self.arrival, tps=completion / max(now - self.arrival, 1e-9),
                     timings=self.generations[0].timings())
