"""A streamed completion read as the fault tests read it: its text, how it ended and when."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai


async def stream_completion(client, model: str, prompt: str, max_tokens: int, started: asyncio.Event,
                            times: list[float] | None = None, errors: list[str] | None = None) -> tuple[str, str, float]:
    """One greedy streamed completion through the openai client: its text, its finish reason
    ("error" for an error event or a connection lost with its gateway's host) and when it ended.
    `started` is set at its first chunk; `times` gets each chunk's arrival; `errors` the error's words."""
    text, finish = [], None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            started.set()
            if times is not None:
                times.append(time.monotonic())
            text.append(chunk.choices[0].text or "")
            finish = chunk.choices[0].finish_reason or finish
    except (openai.APIError, httpx.HTTPError) as exc:
        started.set()
        finish = "error"
        if errors is not None:
            errors.append(f"{type(exc).__name__}: {exc}")
    return "".join(text), finish, time.monotonic()
