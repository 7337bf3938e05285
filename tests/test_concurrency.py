"""16 concurrent greedy requests through the whole stack give exactly what each gives alone."""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = pytest.mark.stack


async def test_sixteen_concurrent_requests_match_alone(async_openai_client, model_name):
    prompts = [f"Write item number {i} of a list of {'very ' * i}interesting facts about the sea:" for i in range(16)]
    max_tokens = [8 + (i * 7) % 25 for i in range(16)]

    async def ask(i: int):
        r = await async_openai_client.completions.create(model=model_name, prompt=prompts[i],
                                                         max_tokens=max_tokens[i], temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    started = time.perf_counter()
    alone = [await ask(i) for i in range(16)]
    sequential_s = time.perf_counter() - started
    started = time.perf_counter()
    together = await asyncio.gather(*(ask(i) for i in range(16)))
    concurrent_s = time.perf_counter() - started
    assert list(together) == alone
    one_s = sequential_s / 16
    print(f"\n16 concurrent: {concurrent_s:.2f}s wall; one request alone: {one_s:.2f}s on average; "
          f"ratio {concurrent_s / one_s:.2f} (16.00 would mean no batching gain)")
