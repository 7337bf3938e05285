"""Errors in OpenAI's shape with the right status, and a fuzz run of malformed requests."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

pytestmark = pytest.mark.stack

ERROR_FIELDS = {"message", "type", "param", "code"}


def test_body_over_the_limit_is_413(stack, model_name):
    big = json.dumps({"model": model_name, "prompt": "x" * (17 * 2**20)})
    r = httpx.post(stack.base_url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and set(r.json()["error"]) == ERROR_FIELDS


def test_over_context_names_the_limit_and_the_prompt(stack, model_name):
    r = httpx.post(stack.base_url + "/v1/completions", timeout=30,
                   json={"model": model_name, "prompt": "hello " * 9000, "max_tokens": 1})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "8192" in message and "9001 in the prompt" in message


def test_tokenize_detokenize_version(stack, model_name):
    ids = httpx.post(stack.base_url + "/tokenize", json={"model": model_name, "prompt": "Hello world"}).json()
    assert ids == {"count": 2, "max_model_len": 8192, "tokens": ids["tokens"], "token_strs": None}
    text = httpx.post(stack.base_url + "/detokenize", json={"model": model_name, "tokens": ids["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat = httpx.post(stack.base_url + "/tokenize",
                      json={"model": model_name, "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 5  # the chat template's markers count too
    assert httpx.get(stack.base_url + "/version").json()["version"]


def test_metrics_use_vllm_names(stack, model_name):
    httpx.post(stack.base_url + "/v1/completions", json={"model": model_name, "prompt": "Hi", "max_tokens": 2},
               timeout=60)
    text = httpx.get(stack.base_url + "/metrics").text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 'vllm:request_success_total{finished_reason="length"', "switchyard_nats_total",
                 "switchyard_scheduler_steps_total", "switchyard_worker_forward_seconds_total",
                 "switchyard_kvcache_blocks", "switchyard_api_requests_in_flight"):
        assert name in text, name


# ---- fuzz -----------------------------------------------------------------------------------

# each corruption makes a body invalid on its own; a fuzzed body gets one to three of them
CORRUPTIONS = [
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", "many"), ("max_tokens", 1.5), ("max_tokens", 10**12),
    ("temperature", -1), ("temperature", 3), ("temperature", "hot"), ("temperature", 1e308),
    ("top_p", 0), ("top_p", -0.5), ("top_p", 2), ("top_k", -5), ("top_k", "all"),
    ("n", 0), ("n", -3), ("n", 10**6), ("n", "two"), ("min_p", -1), ("min_p", 2),
    ("presence_penalty", 5), ("frequency_penalty", -9), ("repetition_penalty", 0), ("repetition_penalty", 3),
    ("seed", 2**70), ("seed", "abc"), ("stop", 5), ("stop", [1, 2]), ("stop", {"a": 1}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [10**9]), ("stop_token_ids", "x"),
    ("logit_bias", {str(i): 1 for i in range(5000)}), ("logit_bias", {"abc": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"99999999": 1}), ("logit_bias", {"5": 500}), ("logit_bias", {"5": "x"}),
    ("min_tokens", -2), ("stream", "maybe"), ("stream_options", 3), ("response_format", {"type": "xml"}),
    ("response_format", {"type": "json_schema"}), ("response_format", {"type": "json_schema",
                                                                       "json_schema": {"schema": {"type": 7}}}),
    ("model", 42), ("model", "no-such-model"), ("model", ["a"]),  # null or "": the served model (vLLM's)
]
COMPLETION_ONLY = [("prompt", 5), ("prompt", None), ("prompt", ""), ("prompt", []), ("prompt", [[]]),
                   ("prompt", [-1, 5]), ("prompt", [10**9]), ("prompt", {"text": "x"}), ("prompt", [1.5, 2]),
                   ("prompt", ["ok", 3]), ("prompt", "\ud800 lone surrogate"), ("logprobs", -1), ("logprobs", 21),
                   ("logprobs", "x"), ("echo", "sure")]
CHAT_ONLY = [("messages", []), ("messages", None), ("messages", "hi"), ("messages", [{"role": "", "content": "x"}]), ("messages", [{"role": 5, "content": "x"}]),
             ("messages", [{"content": "x"}]), ("messages", [{"role": "user", "content": 5}]),
             ("messages", [{"role": "user", "content": [{"type": "image", "url": "x"}]}]),
             ("messages", [{"role": "user", "content": "\udfff"}]), ("top_logprobs", 50), ("logprobs", "x"),
             ("max_completion_tokens", -5)]
RAW_BODIES = [b"{not json", b"", b"[]", b"42", b'"text"', b"null", b'{"model": "\xff\xfe"}',
              b'{"prompt": "\xc3\x28"}', b"{" * 5000, b'{"model": 1e999}']


def fuzzed(rng: random.Random, model: str) -> tuple[str, bytes]:
    if rng.random() < 0.1:
        return rng.choice(["/v1/completions", "/v1/chat/completions"]), rng.choice(RAW_BODIES)
    is_chat = rng.random() < 0.5
    body = {"model": model, "max_tokens": 4}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if is_chat else {"prompt": "Hi"})
    pool = CORRUPTIONS + (CHAT_ONLY if is_chat else COMPLETION_ONLY)
    for field, value in rng.sample(pool, rng.randint(1, 3)):
        body[field] = value
    if rng.random() < 0.1:
        del body["messages" if is_chat else "prompt"]  # a required field missing is an error of its own
    return ("/v1/chat/completions" if is_chat else "/v1/completions"), json.dumps(body).encode()


async def test_fuzz_malformed_requests_get_4xx_and_the_server_keeps_serving(stack, model_name):
    rng = random.Random(2026)
    cases = [fuzzed(rng, model_name) for _ in range(2500)]
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        async def send(path: str, body: bytes) -> None:
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert 400 <= r.status_code < 500, (r.status_code, body[:300], r.text[:300])
            assert set(r.json()["error"]) == ERROR_FIELDS, body[:300]

        for start in range(0, len(cases), 16):
            await asyncio.gather(*(send(p, b) for p, b in cases[start : start + 16]))
        ok = await client.post("/v1/completions", json={"model": model_name, "prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    print(f"\nfuzz: {len(cases)} requests, statuses {sorted(statuses.items())}")
