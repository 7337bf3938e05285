"""vLLM's request extensions and routes, each with its effect, against the real stack; a field
nobody declares is refused by name, as OpenAI refuses it."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

pytestmark = pytest.mark.stack
ASK = [{"role": "user", "content": "Name a color."}]


def chat(client, model, **extra):
    return client.chat.completions.create(model=model, messages=ASK, max_tokens=20, extra_body=extra,
                                          **{k: extra.pop(k) for k in ("temperature", "seed") if k in extra})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_choice_and_regex_bind_the_output(openai_client, model_name, temperature):
    for seed in range(3):
        r = chat(openai_client, model_name, guided_choice=["red", "green", "blue"], temperature=temperature, seed=seed)
        assert r.choices[0].message.content in ("red", "green", "blue")
        r = chat(openai_client, model_name, guided_regex=r"#[0-9a-f]{6}", temperature=temperature, seed=seed)
        assert re.fullmatch(r"#[0-9a-f]{6}", r.choices[0].message.content)
    so = chat(openai_client, model_name, structured_outputs={"choice": ["yes", "no"]}, temperature=temperature)
    assert so.choices[0].message.content in ("yes", "no")


def test_guided_json_and_structured_outputs_json_give_valid_json(openai_client, model_name):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]},
                                               "shade": {"type": "integer"}},
              "required": ["color", "shade"], "additionalProperties": False}
    for body in ({"guided_json": schema}, {"guided_json": json.dumps(schema)}, {"structured_outputs": {"json": schema}}):
        r = chat(openai_client, model_name, **body, temperature=0.0)
        value = json.loads(r.choices[0].message.content)
        assert value["color"] in ("red", "blue") and isinstance(value["shade"], int)


def test_one_constraint_at_a_time(openai_client, model_name):
    with pytest.raises(openai.BadRequestError, match="at most one constraint on the output, got guided_choice, "
                                                      "guided_regex"):
        chat(openai_client, model_name, guided_choice=["a"], guided_regex="b")
    with pytest.raises(openai.BadRequestError, match="guided_regex: invalid regex"):
        chat(openai_client, model_name, guided_regex="(unclosed")


def test_allowed_token_ids_and_token_ids_as_logprob_tokens(openai_client, model_name, hf_tokenizer):
    allowed = hf_tokenizer.encode(" one two three four", add_special_tokens=False)
    r = openai_client.completions.create(model=model_name, prompt="Count:", max_tokens=6, temperature=1.0, seed=3,
                                         logprobs=1, extra_body={"allowed_token_ids": allowed,
                                                                 "return_tokens_as_token_ids": True})
    tokens = r.choices[0].logprobs.tokens
    assert len(tokens) == 6 and all(t.startswith("token_id:") and int(t[9:]) in allowed for t in tokens)
    assert all(k.startswith("token_id:") for top in r.choices[0].logprobs.top_logprobs for k in top)
    c = openai_client.chat.completions.create(model=model_name, messages=ASK, max_tokens=3, logprobs=True,
                                              top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = c.choices[0].logprobs.content
    assert all(e.token.startswith("token_id:") for e in content)
    assert all(a.token.startswith("token_id:") for e in content for a in e.top_logprobs)


def test_continuous_usage_stats_put_the_usage_on_every_chunk(openai_client, model_name):
    chunks = list(openai_client.chat.completions.create(
        model=model_name, messages=ASK, max_tokens=5, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage is not None for c in chunks)


@pytest.mark.parametrize(("body", "message"), [
    ({"stream_options": {"include_usage": True}}, "The 'stream_options' parameter is only allowed when 'stream' "
                                                  "is enabled."),
    ({"length_penalty": 0.5}, "length_penalty ranks beams: it needs use_beam_search"),
    ({"use_beam_search": True, "stop": ["."]}, "stop cannot be combined with use_beam_search"),
    ({"use_beam_search": True, "top_p": 0.5}, "use_beam_search ranks beams by the model's logprobs: top_p"),
    ({"store": True}, "Unrecognized request argument supplied: store"),
    ({"guided_decoding_backend": "outlines"}, "Unrecognized request argument supplied: guided_decoding_backend"),
    ({"stream_options": {"include_usage": True, "extra": 1}, "stream": True},
     "Unrecognized request argument supplied: stream_options.extra"),
])
def test_what_is_not_served_is_refused_by_name(stack, model_name, body, message):
    reply = httpx.post(f"{stack.base_url}/v1/chat/completions",
                       json={"model": model_name, "messages": ASK, "max_tokens": 2, **body}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["message"].startswith(message)
    ok = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60,  # null: nothing asked, nothing refused
                    json={"model": model_name, "messages": ASK, "max_tokens": 2, "store": None})
    assert ok.status_code == 200


def test_vllms_routes(stack, model_name, hf_tokenizer):
    base = stack.base_url
    tokenized = httpx.post(f"{base}/tokenize", json={"model": model_name, "prompt": "Hello world",
                                                      "return_token_strs": True}).json()
    assert tokenized["tokens"] == hf_tokenizer.encode("Hello world")
    assert tokenized["token_strs"] == hf_tokenizer.convert_ids_to_tokens(tokenized["tokens"])  # the vocabulary's
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert info["model"] == model_name and info["vocab_size"] == 49152 and "<|im_start|>" in info["chat_template"]
    assert httpx.get(f"{base}/load").json() == {"server_load": 0}
    as_chat = httpx.post(f"{base}/invocations", json={"model": model_name, "messages": ASK, "max_tokens": 3}).json()
    assert as_chat["object"] == "chat.completion"
    as_completion = httpx.post(f"{base}/invocations", json={"model": model_name, "prompt": "Hi", "max_tokens": 3})
    assert as_completion.json()["object"] == "text_completion"
    neither = httpx.post(f"{base}/invocations", json={"model": model_name})
    assert neither.status_code == 400 and "needs `messages`" in neither.json()["error"]["message"]


def _series(text: str, name: str, model: str) -> float:
    pattern = rf'^{re.escape(name)}\{{[^}}]*model_name="{re.escape(model)}"[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_vllms_request_and_engine_series(stack, model_name):
    names = ("vllm:request_params_n_sum", "vllm:request_params_max_tokens_sum", "vllm:request_generation_tokens_sum",
             "vllm:request_prompt_tokens_count", "vllm:request_inference_time_seconds_count",
             "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
             "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum")
    before = httpx.get(f"{stack.base_url}/metrics").text
    reply = httpx.post(f"{stack.base_url}/v1/completions", timeout=60, json={
        "model": model_name, "prompt": "One two three", "max_tokens": 3, "n": 2, "ignore_eos": True})
    assert reply.status_code == 200
    after = httpx.get(f"{stack.base_url}/metrics").text
    delta = {n: _series(after, n, model_name) - _series(before, n, model_name) for n in names}
    assert delta["vllm:request_params_n_sum"] == 2 and delta["vllm:request_params_max_tokens_sum"] == 3
    assert delta["vllm:request_generation_tokens_sum"] == 6 and delta["vllm:request_prompt_tokens_count"] == 2
    for phase in ("inference", "prefill", "decode"):
        assert delta[f"vllm:request_{phase}_time_seconds_count"] == 2
    assert delta["vllm:iteration_tokens_total_count"] >= 3  # a prefill, then decode iterations
    assert delta["vllm:iteration_tokens_total_sum"] == 2 * (3 + 3)  # each choice: its prompt and its tokens
    (info,) = re.findall(r'^vllm:cache_config_info\{([^}]*)\} 1\.0$', after, re.M)
    assert 'block_size="16"' in info and 'enable_prefix_caching="True"' in info and 'num_gpu_blocks="' in info


def test_engine_series_count_as_vllms_test_metrics_counts_does(stack, model_name, hf_tokenizer):
    """vLLM's test_metrics_counts: 10 completions of a 9-token prompt, 10 tokens each, one at a time;
    the readiness probes the stack answered meanwhile are in none of the engine's series."""
    names = ("vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count",
             "vllm:request_num_preemptions_count", "vllm:prefix_cache_queries_total")
    prompt_ids = hf_tokenizer.encode("Hello my name is Robert and I love magic")
    before = httpx.get(f"{stack.base_url}/metrics").text
    for _ in range(10):
        httpx.get(f"{stack.base_url}/ready", timeout=60).raise_for_status()  # a probe: one token, uncounted
        reply = httpx.post(f"{stack.base_url}/v1/completions", timeout=60, json={
            "model": model_name, "prompt": prompt_ids, "max_tokens": 10, "ignore_eos": True})
        assert reply.json()["usage"]["completion_tokens"] == 10
    # read once, at once, as vLLM's test does: the last Step's result may reach the scheduler just
    # after its tokens reached the client, and a scrape waits for it (SchedulerStatsRequest.settled)
    after = httpx.get(f"{stack.base_url}/metrics").text
    delta = {n: _series(after, n, model_name) - _series(before, n, model_name) for n in names}
    assert delta["vllm:iteration_tokens_total_sum"] == 10 * (len(prompt_ids) + 10)
    assert delta["vllm:iteration_tokens_total_count"] == 10 * 10
    assert delta["vllm:request_num_preemptions_count"] == 10
    assert delta["vllm:prefix_cache_queries_total"] == 10 * len(prompt_ids)
    for reason in ("capacity", "deferred"):
        assert re.search(rf'^vllm:num_requests_waiting_by_reason\{{model_name="{model_name}",reason="{reason}"\}} 0\.0$',
                         after, re.M)
    for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
        assert f'vllm:admission_rejections_total{{model_name="{model_name}",reason="{reason}"}} ' in after
    (info,) = re.findall(r'^vllm:cache_config_info\{([^}]*)\} 1\.0$', after, re.M)
    blocks, size = re.search(r'num_gpu_blocks="(\d+)"', info)[1], re.search(r'kv_cache_size_tokens="(\d+)"', info)[1]
    assert int(size) == 16 * int(blocks)
    assert float(re.search(r'kv_cache_max_concurrency="([\d.]+)"', info)[1]) > 0


def test_continue_final_message_leaves_the_last_turn_open(stack, openai_client, model_name, hf_tokenizer):
    prefill = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    tokenized = httpx.post(f"{stack.base_url}/tokenize", json={
        "model": model_name, "messages": prefill, "add_generation_prompt": False, "continue_final_message": True}).json()
    assert hf_tokenizer.decode(tokenized["tokens"]).endswith("<|im_start|>assistant\nThe capital of France is")
    r = openai_client.chat.completions.create(model=model_name, messages=prefill, max_tokens=5, temperature=0,
                                              extra_body={"add_generation_prompt": False,
                                                          "continue_final_message": True})
    assert "Paris" in r.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        openai_client.chat.completions.create(model=model_name, messages=prefill, max_tokens=5,
                                              extra_body={"continue_final_message": True})


def test_prompt_logprobs_in_vllms_shape(stack, model_name, hf_tokenizer):
    prompt = "The capital of France is Paris"
    ids = hf_tokenizer.encode(prompt)
    body = {"model": model_name, "prompt": prompt, "max_tokens": 1}
    echoed = httpx.post(f"{stack.base_url}/v1/completions", timeout=60,
                        json={**body, "echo": True, "logprobs": 0}).json()["choices"][0]["logprobs"]
    choice = httpx.post(f"{stack.base_url}/v1/completions", timeout=60,
                        json={**body, "prompt_logprobs": 2}).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for pos in range(1, len(ids)):
        own = scored[pos][str(ids[pos])]
        assert abs(own["logprob"] - echoed["token_logprobs"][pos]) < 1e-4 and own["rank"] >= 1
        ranked = sorted(scored[pos].values(), key=lambda e: e["rank"])
        assert ranked[0]["rank"] == 1 and ranked[0]["logprob"] >= own["logprob"]
    chat = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "model": model_name, "messages": ASK, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    streamed = httpx.post(f"{stack.base_url}/v1/completions", timeout=60, json={**body, "prompt_logprobs": 1,
                                                                                   "stream": True})
    assert streamed.status_code == 400 and "not available when streaming" in streamed.text


@pytest.mark.parametrize(("requested", "sampled"), [([5000], 42), ([100, 1000, 5000], 42), ([100, 1000, 5000], 5000)])
def test_logprob_token_ids_give_those_tokens_and_the_sampled_one(openai_client, model_name, requested, sampled):
    """vLLM's test_logprob_token_ids: the named tokens' logprobs (finite, though allowed_token_ids
    masks them from sampling: logprobs are the model's own) and the sampled token's, each once."""
    reply = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hello"}], max_tokens=1, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"logprob_token_ids": requested, "allowed_token_ids": [sampled],
                                                   "return_tokens_as_token_ids": True})
    (first,) = reply.choices[0].logprobs.content
    assert first.token == f"token_id:{sampled}"
    ids = [int(e.token.removeprefix("token_id:")) for e in first.top_logprobs]
    assert sorted(ids) == sorted({*requested, sampled})
    assert all(-1e4 < e.logprob <= 0.0 for e in first.top_logprobs)
    assert next(e.logprob for e in first.top_logprobs if e.token == first.token) == first.logprob


def test_logprob_token_ids_streamed_and_in_completions(openai_client, model_name):
    stream = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hello"}], max_tokens=1, temperature=0,
        logprobs=True, stream=True, extra_body={"logprob_token_ids": [5000], "allowed_token_ids": [42],
                                                "return_tokens_as_token_ids": True})
    streamed = [int(e.token.removeprefix("token_id:")) for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for content in chunk.choices[0].logprobs.content for e in content.top_logprobs]
    assert sorted(streamed) == [42, 5000]
    completion = openai_client.completions.create(model=model_name, prompt="Hello", max_tokens=2, temperature=0,
                                                  logprobs=5, extra_body={"logprob_token_ids": [7, 9],
                                                                          "return_tokens_as_token_ids": True})
    logprobs = completion.choices[0].logprobs
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):  # the chosen first, then the named
        assert list(top)[0] == token and set(top) == {token, "token_id:7", "token_id:9"}


@pytest.mark.parametrize(("extra", "message"), [
    ({"logprob_token_ids": [5]}, "`logprobs` must be set"),
    ({"logprob_token_ids": [10**6], "logprobs": 1}, "logprob_token_ids"),
    ({"logprob_token_ids": list(range(129)), "logprobs": 1}, "logprob_token_ids"),
    ({"logprob_token_ids": [5], "logprobs": 1, "use_beam_search": True, "n": 2}, "logprob_token_ids"),
])
def test_logprob_token_ids_refused_with_the_reason(stack, model_name, extra, message):
    reply = httpx.post(f"{stack.base_url}/v1/completions", timeout=60,
                       json={"model": model_name, "prompt": "Hi", "max_tokens": 1, **extra})
    assert reply.status_code == 400 and message in reply.text
