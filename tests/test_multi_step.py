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

    s = _start_stack(tmp_path_factory, "multi-step", num_workers=1,
                     extra_args=["--num-scheduler-steps", "4", "--enable-per-request-metrics"])
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


TIMINGS = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}


def test_per_request_metrics_as_vllms_test_chat_completion_reads_them(multi_step_stack, stack, model_name):
    """--enable-per-request-metrics (this stack's): vLLM's `metrics` object in an answer of one
    choice, on a stream's final usage chunk only, none for n > 1; and none without the flag."""
    import openai

    client = openai.OpenAI(base_url=multi_step_stack.base_url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": model_name, "messages": [{"role": "user", "content": "Count to four."}], "temperature": 0}
    whole = client.chat.completions.create(**ask, max_completion_tokens=4, extra_body={"min_tokens": 4})
    metrics = whole.model_extra["metrics"]
    assert set(metrics) == TIMINGS and all(v >= 0 for v in metrics.values()) and metrics["tokens_per_second"] > 0
    chunks = list(client.chat.completions.create(**ask, max_completion_tokens=1, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all("metrics" not in (c.model_extra or {}) for c in chunks[:-1])
    assert set(chunks[-1].model_extra["metrics"]) == TIMINGS - {"mean_itl_ms"}  # one token: no gap to average
    two = httpx.post(f"{multi_step_stack.base_url}/v1/completions", timeout=60,
                     json={"model": model_name, "prompt": "Hi", "max_tokens": 3, "n": 2}).json()
    assert "metrics" not in two
    plain = httpx.post(f"{stack.base_url}/v1/completions", timeout=60,
                       json={"model": model_name, "prompt": "Hi", "max_tokens": 3}).json()
    assert "metrics" not in plain
