"""Hostile input never costs a 5xx, a hang, a reset connection or another client's stream."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bench import fuzz
from services.api.openai.chat_template import ChatTemplateError, render_chat
from shared.config import ConfigError
from shared.control.deploy_config import check_name
from tests.conftest import _start_stack

MESSAGES = [{"role": "user", "content": "a" * 3000}]
SMALL_PAYLOAD = 64 * 1024


@pytest.mark.parametrize(("template", "why"), [
    ("{{ 'x' * 10000000 }}", "builds a value longer than"),
    # a million traced iterations take about a second: on a loaded machine the 2 s limit may come first
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "loops more than|ran longer than"),
    ("{{ range(10**9) | list }}", "passes a number above"),
    ("{{ range(2000000) | list | length }}", "loops more than|ran longer than"),  # as above, on a loaded machine
    ("{% include 'other' %}", "no loader"),
    ("{% import 'x' as y %}", "no loader"),
    ("{{ 10 ** 100000000 }}", "power above 64"),
    ("{{ 'x'.center(10**10) }}", "passes a number above"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "builds a value longer than"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(30) %}{% set ns.s = ns.s|replace('x', 'xxxx') %}{% endfor %}",
     "builds a value longer than"),
    ("{% for a in messages[0].content %}{% for b in messages[0].content %}{% for c in messages[0].content %}"
     "{% endfor %}{% endfor %}{% endfor %}", "ran longer than"),
    ("{{ messages[0].content | tojson(indent=10000000) }}", "passes a number above"),
])
def test_a_template_that_breaks_a_limit_is_a_clear_error(template, why):
    with pytest.raises(ChatTemplateError, match=why):
        render_chat(template, MESSAGES, bos_token=None, eos_token=None)


def test_a_real_template_renders_under_the_limits(hf_tokenizer):
    text = render_chat(hf_tokenizer.chat_template, [{"role": "user", "content": "Hi"}], bos_token=None,
                       eos_token=None)
    assert text == hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                   add_generation_prompt=True)


@pytest.mark.parametrize("name", ["ok\n", "a*", "x>", "a b", "名前", "", "-a", "a" * 64])
def test_registry_names_are_one_clean_token(name):
    with pytest.raises(ConfigError):
        check_name("model", name)


@pytest.mark.stack
async def test_fuzz_every_route(stack, model_name):
    """bench/fuzz.py's cases (docs/benchmarks.md has a longer run): 0 x 5xx, hangs and resets."""
    result = await fuzz.run(stack.base_url, model_name, count=5000, seed=2026, timeout=60)
    assert not result["bad"], [(s, c.method, c.path, (c.body or b"")[:200], str(c.data)[:200])
                               for s, c in result["bad"][:10]]
    assert result["alive"] and not result["stuck_uploads"]
    print(f"\nfuzz: {result['requests']} requests, {sorted(result['outcomes'].items(), key=str)}")


@pytest.mark.stack
async def test_a_huge_prompt_is_refused_before_tokenizing_and_never_stalls_another_stream(stack, model_name):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        async def streamed() -> tuple[int, float]:
            gaps, last, count = [], time.monotonic(), 0
            async with http.stream("POST", "/v1/completions", json={
                    "model": model_name, "prompt": "Tell me a story.", "max_tokens": 48, "stream": True,
                    "ignore_eos": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        gaps.append(now - last)
                        last, count = now, count + 1
            return count, max(gaps[1:])

        stream = asyncio.create_task(streamed())
        huge = "word " * (3 * 2**20)  # 15 MiB
        started = time.monotonic()
        refused = await http.post("/v1/completions", json={"model": model_name, "prompt": huge, "max_tokens": 2})
        refused_after = time.monotonic() - started
        count, widest_gap = await stream
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in refused.json()["error"]["message"]
    assert count > 10  # tokens kept coming (a token whose text is empty sends no chunk)
    print(f"\n15 MiB prompt refused after {refused_after:.2f}s; the other stream's widest gap {widest_gap:.2f}s")


@pytest.fixture(scope="module")
def small_payload_stack(tmp_path_factory):
    """A stack whose nats-server takes messages of at most 64 KiB (a deployment may set it lower than
    the default 1 MB): a prompt's logprobs pass it at 1,000 tokens rather than 5,000."""
    stack = _start_stack(tmp_path_factory, "small-payload", num_workers=1, extra_args=[], max_payload=SMALL_PAYLOAD)
    yield stack
    stack.stop()


@pytest.mark.stack
async def test_logprobs_too_large_for_one_bus_message_fail_that_request_alone(small_payload_stack, model_name):
    """20 prompt logprobs over a 1,000-token prompt pass the bus's max payload in one entry: that
    request ends with an error naming it, at once, and a request beside it (same gateway, same token
    batch) finishes as it would alone."""
    small = {"model": model_name, "prompt": "The sea is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    huge = {"model": model_name, "prompt": [17] * 1000, "max_tokens": 1, "prompt_logprobs": 20}
    async with httpx.AsyncClient(base_url=small_payload_stack.base_url, timeout=300) as http:
        lone = (await http.post("/v1/completions", json=small)).json()["choices"][0]["text"]
        big, beside = await asyncio.gather(http.post("/v1/completions", json=huge),
                                           http.post("/v1/completions", json=small))
    assert big.status_code >= 400 and f"({SMALL_PAYLOAD:,}, nats-server's max_payload)" in big.json()["error"]["message"]
    assert beside.json()["choices"][0]["text"] == lone
