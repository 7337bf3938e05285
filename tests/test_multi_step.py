"""`--num-scheduler-steps 4` through the real services: the worker runs several decode iterations
per Step and streams each token as it comes; clients see exactly what one iteration per Step gives."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = pytest.mark.stack

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at",
           "The three primary colors are", "My favourite book is"]


@pytest.fixture(scope="module")
def multi_step_stack(tmp_path_factory):
    from tests.conftest import _start_stack

    s = _start_stack(tmp_path_factory, "multi-step", num_workers=1, extra_args=["--num-scheduler-steps", "4"])
    yield s
    s.stop()


async def _stream(client, model: str, prompt: str, max_tokens: int, stop: list[str] | None = None):
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stop=stop, stream_options={"include_usage": True})
    text, finish, usage, num_chunks = "", None, None, 0
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            num_chunks += 1
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return text, finish, usage, num_chunks


def test_multi_step_streams_what_single_step_does(multi_step_stack, stack, model_name):
    openai = pytest.importorskip("openai")

    async def run(base_url: str):
        # a client of its own, on this event loop (the session's async client lives on pytest's)
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            requests = [_stream(client, model_name, p, 5 + 7 * i) for i, p in enumerate(PROMPTS)]
            requests.append(_stream(client, model_name, "Count: 1, 2, 3, 4,", 40, stop=[" 9"]))
            return await asyncio.gather(*requests)

    single = asyncio.run(run(stack.base_url))
    multi = asyncio.run(run(multi_step_stack.base_url))
    for (text, finish, usage, num_chunks), expected in zip(multi, single, strict=True):
        assert (text, finish, usage) == expected[:3]
        assert num_chunks * 2 >= expected[3]  # streamed per iteration (equal here), not a burst per Step
    assert multi[-1][1] == "stop" and "9" not in multi[-1][0]
    # one iteration per Step would need a Step per token of the longest request; multi-step fewer
    metrics = httpx.get(multi_step_stack.base_url + "/metrics", timeout=10).text
    num_steps = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("switchyard_scheduler_steps_total"))
    assert 0 < num_steps < max(usage for _, _, usage, _ in multi), metrics
