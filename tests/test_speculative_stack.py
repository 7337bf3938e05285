"""--speculative-config through the real services at `make run`'s defaults: the OpenAI answers (greedy,
seeded, logprobs, stop strings, guided JSON, chat) are the session stack's without speculation, by
n-gram, by a draft model and by an EAGLE-3 head, vLLM's spec_decode counters move, and a worker killed mid-stream loses
no token."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.streaming import stream_completion
from tests.test_two_workers import _wait_for_workers

pytestmark = pytest.mark.stack
openai = pytest.importorskip("openai")
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
PROMPTS = [
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Count: one, two, three, four, five, six, seven, eight, nine, ten. Again: one, two,",
    '{"name": "Ada", "age": 36, "city": "London"}\nThe same JSON with the age 37: {"name": "Ada",',
]


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory, model_name):
    from tests.conftest import _start_stack

    s = _start_stack(tmp_path_factory, "speculative", num_workers=2,
                     extra_args=["--speculative-config", json.dumps(SPEC)])
    asyncio.run(_wait_for_workers(s.admin_url, model_name, 2))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def draft_stack(tmp_path_factory, default_model_path):
    """The draft_model method, SmolLM2 drafting for itself (a user's draft is smaller; the answers
    are the target's either way)."""
    from tests.conftest import _start_stack

    draft = {"model": default_model_path, "num_speculative_tokens": 3, "disable_by_batch_size": 16}
    s = _start_stack(tmp_path_factory, "draft-model", num_workers=1, extra_args=["--speculative-config", json.dumps(draft),
                                                                         "--kv-cache-memory-gib", "0.8"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def eagle_stack(tmp_path_factory, default_model_path):
    """The eagle3 method: a random EAGLE-3 head for SmolLM2 written by vLLM's speculators (it drafts
    badly; the answers are the target's either way), read from the target's layers 2, 15 and 27."""
    from tests.conftest import _start_stack

    pytest.importorskip("speculators")
    from bench.speculative import random_eagle3_head

    head = random_eagle3_head(default_model_path, str(tmp_path_factory.mktemp("smollm2-eagle3")))
    config = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "disable_by_batch_size": 16}
    s = _start_stack(tmp_path_factory, "eagle3", num_workers=1, extra_args=["--speculative-config", json.dumps(config)])
    yield s
    s.stop()


def _client(stack):
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="-", max_retries=0, timeout=300)


async def _answers(stack, model: str) -> list:
    """Every kind of request at once, so that speculating rows share steps with the others."""
    client = _client(stack)
    completions = [client.completions.create(model=model, prompt=p, max_tokens=40, temperature=0, logprobs=2)
                   for p in PROMPTS]
    seeded = [client.completions.create(model=model, prompt=p, max_tokens=40, temperature=0.8, top_p=0.95, seed=5)
              for p in PROMPTS]
    stopped = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=60, temperature=0, stop=[" six"])
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=40, temperature=0)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    guided = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Ada is 36. Say it as JSON: " + PROMPTS[3]}],
        max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    answers = await asyncio.gather(*completions, *seeded, stopped, chat, guided)
    await client.close()
    return answers


def _summary(answer) -> tuple:
    choice = answer.choices[0]
    if hasattr(choice, "message"):
        return choice.message.content, choice.finish_reason, answer.usage.completion_tokens
    logprobs = choice.logprobs.token_logprobs if choice.logprobs else None
    return choice.text, choice.finish_reason, answer.usage.completion_tokens, logprobs


def _accepted(stack) -> float:
    metrics = httpx.get(stack.base_url + "/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))


def test_a_draft_models_answers_are_those_without_speculation(draft_stack, stack, model_name):
    plain = [_summary(a) for a in asyncio.run(_answers(stack, model_name))]
    spec = [_summary(a) for a in asyncio.run(_answers(draft_stack, model_name))]
    for got, want in zip(spec, plain, strict=True):
        assert got[:3] == want[:3]
    assert _accepted(draft_stack) > 0
    models = httpx.get(draft_stack.base_url + "/v1/models", timeout=10).text
    assert "draft model" in models


def test_an_eagle3_heads_answers_are_those_without_speculation(eagle_stack, stack, model_name):
    plain = [_summary(a) for a in asyncio.run(_answers(stack, model_name))]
    spec = [_summary(a) for a in asyncio.run(_answers(eagle_stack, model_name))]
    for got, want in zip(spec, plain, strict=True):
        assert got[:3] == want[:3]
    metrics = httpx.get(eagle_stack.base_url + "/metrics", timeout=10).text
    assert any(line.startswith("vllm:spec_decode_num_drafts_total") and float(line.split()[-1]) > 0
               for line in metrics.splitlines())
    assert "EAGLE-3 head drafting from 2048 tokens" in httpx.get(eagle_stack.base_url + "/v1/models", timeout=10).text


def test_the_answers_are_those_without_speculation(spec_stack, stack, model_name):
    plain = [_summary(a) for a in asyncio.run(_answers(stack, model_name))]
    spec = [_summary(a) for a in asyncio.run(_answers(spec_stack, model_name))]
    for got, want in zip(spec, plain, strict=True):
        assert got[:3] == want[:3]
        if len(want) > 3 and want[3] is not None:  # a draft's row computes a token's logits as a decode row does
            assert got[3] == pytest.approx(want[3], abs=1e-4)
    assert "six" not in spec[2 * len(PROMPTS)][0] and spec[2 * len(PROMPTS)][1] == "stop"
    json.loads(spec[-1][0])  # the guided answer parses
    metrics = httpx.get(spec_stack.base_url + "/metrics", timeout=10).text
    values = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode") and 'position="0"' not in line}
    accepted = values["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= values["vllm:spec_decode_num_draft_tokens_total"]
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    first = next(line for line in metrics.splitlines() if 'position="0"' in line)
    assert 0 < float(first.split()[-1]) <= accepted
    assert "vllm:spec_decode" not in httpx.get(stack.base_url + "/metrics", timeout=10).text  # off: no series


async def test_a_worker_killed_while_its_rows_speculate_loses_no_token(spec_stack, model_name):
    """Eight greedy streams over both workers; one worker SIGKILLed after their first tokens. Its
    requests are recomputed on the other, which speculates on, and every stream ends with its lone
    run's text."""
    client = _client(spec_stack)
    prompts = PROMPTS * 2
    alone = {p: (await stream_completion(client, model_name, p, 120, asyncio.Event()))[:2] for p in PROMPTS}
    started = [asyncio.Event() for _ in prompts]
    streams = [asyncio.create_task(stream_completion(client, model_name, p, 120, e))
               for p, e in zip(prompts, started, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    victim = spec_stack.service("worker-1")
    victim.proc.kill()
    try:
        results = await asyncio.wait_for(asyncio.gather(*streams), 300)
    finally:
        victim.proc.wait(timeout=10)
        victim.start(spec_stack._env(victim.name))
        await client.close()
    for prompt, (text, finish, _) in zip(prompts, results, strict=True):
        assert (text, finish) == alone[prompt]
