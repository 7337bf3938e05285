"""Reasoning parsers: a chat answer's thinking becomes reasoning_content (whole, streamed, and a
Responses API reasoning item), tool calls after the thinking stay tool calls, and chat_template_kwargs
reach the template. The stack runs SmolLM2 with a template of our own that opens `<think>` as
DeepSeek-R1's and Qwen3's do (SmolLM2 does not reason: its whole answer is then thinking), and
closes it when `enable_thinking` is false, as Qwen3's does."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from services.api.context import ServedModel
from services.api.openai.body import validate
from services.api.openai.generation import Delta
from services.api.openai.protocol import ChatCompletionRequest
from services.api.openai.reasoning import ReasoningSplitter
from services.api.openai.responder import ChatResponder
from services.api.openai.tools.choice import plan_tools
from shared.models.tokenizer import load_tokenizer

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize(("parser", "prompt", "pieces", "expected"), [
    ("deepseek_r1", "assistant\n", ["I think", " hard</th", "ink>\n\nParis."], ("I think hard", "\n\nParis.")),
    ("deepseek_r1", "<think>\nold</think>\n", ["Paris."], ("", "Paris.")),  # the prompt closed it
    ("qwen3", "assistant\n", ["<th", "ink>plan</think>", "Paris."], ("plan", "Paris.")),
    ("qwen3", "assistant\n", ["<tho", "ught"], ("", "<thought")),  # not the tag after all
    ("qwen3", "assistant\n<think>\n", ["never closed"], ("never closed", "")),
])
def test_the_splitter_finds_the_thinking_whatever_the_deltas(parser, prompt, pieces, expected):
    splitter, reasoning, content = ReasoningSplitter(parser, prompt), "", ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    assert (reasoning + r, content + c) == expected


def test_a_tool_call_after_the_thinking_is_a_tool_call_streamed_and_whole(default_model_path):
    model = ServedModel(name="m", tokenizer=load_tokenizer(default_model_path), created=0)
    body = validate(ChatCompletionRequest, {"model": "m", "messages": ASK, "tools": [WEATHER], "stream": True})
    deltas = [Delta("<think>The user wants the weath"), Delta("er; call the tool.</th"),
              Delta('ink>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                    finish_reason="stop")]
    responder = ChatResponder(model, body, 1, plan_tools(body, "hermes"),
                              reasoning=lambda: ReasoningSplitter("qwen3", "assistant\n"))
    chunks = [c for d in deltas for c in responder.chunks("id", 0, 0, d)]
    thought = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert thought == "The user wants the weather; call the tool."
    assert calls[0]["function"]["name"] == "get_weather" and json.loads(calls[1]["function"]["arguments"]) == {
        "city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    message = responder.response("id", 0, None)["choices"][0]["message"]
    assert message["reasoning_content"] == thought and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["content"] is None


@pytest.fixture(scope="module")
def thinking_stack(tmp_path_factory):
    from tests.conftest import _start_stack

    s = _start_stack(tmp_path_factory, "reasoning", num_workers=1, extra_args=[
        "--reasoning-parser", "qwen3",
        "--openai-config", json.dumps({"chat_completion_config": {"chat_template": TEMPLATE}})])
    yield s
    s.stop()


def _plain_answer(base_url: str, model_name: str, **kwargs) -> tuple[str, str]:
    """What the model writes after the rendered prompt, as a completion (no parser), and why it ended."""
    ids = httpx.post(base_url + "/tokenize", json={"model": model_name, "messages": ASK, **kwargs}).json()["tokens"]
    choice = httpx.post(base_url + "/v1/completions", json={"model": model_name, "prompt": ids, "max_tokens": 12,
                                                           "temperature": 0}, timeout=60).json()["choices"][0]
    return choice["text"], choice["finish_reason"]


@pytest.mark.stack
def test_thinking_is_reasoning_content_whole_streamed_and_in_responses(thinking_stack, model_name):
    base = thinking_stack.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    thought, finish = _plain_answer(base, model_name)
    whole = client.chat.completions.create(model=model_name, messages=ASK, max_tokens=12, temperature=0)
    message = whole.choices[0].message
    assert message.reasoning_content == thought and message.content is None  # it never closed its thinking
    assert message.reasoning == thought  # vLLM's current name, beside the earlier one
    assert whole.choices[0].finish_reason == finish
    chunks = list(client.chat.completions.create(model=model_name, messages=ASK, max_tokens=12, temperature=0,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == thought
    assert not "".join(d.content or "" for d in deltas) and chunks[-1].choices[0].finish_reason == finish
    hidden = client.chat.completions.create(model=model_name, messages=ASK, max_tokens=12, temperature=0,
                                            extra_body={"include_reasoning": False})  # vLLM's: the thinking left out
    assert hidden.choices[0].message.reasoning is None and not hidden.choices[0].message.content
    response = client.responses.create(model=model_name, input="What is the capital of France?",
                                       max_output_tokens=12, temperature=0)
    assert response.output[0].type == "reasoning" and response.output[0].content[0].text == thought
    events = [e.type for e in client.responses.create(model=model_name, input="What is the capital of France?",
                                                      max_output_tokens=12, temperature=0, stream=True)]
    assert "response.reasoning_text.delta" in events and events[-1] == "response.completed"


@pytest.mark.stack
def test_chat_template_kwargs_reach_the_template(thinking_stack, model_name):
    base = thinking_stack.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    answer, _ = _plain_answer(base, model_name, chat_template_kwargs={"enable_thinking": False})
    reply = client.chat.completions.create(model=model_name, messages=ASK, max_tokens=12, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content == answer and reply.choices[0].message.reasoning_content is None
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs cannot set 'messages'"):
        client.chat.completions.create(model=model_name, messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})


def _ids(base: str, model_name: str, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """A plain completion's token ids and text (no parser), greedy."""
    choice = httpx.post(base + "/v1/completions", json={
        "model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True}, timeout=60).json()["choices"][0]
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]], choice["text"]


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True])
def test_a_thinking_budget_closes_the_thinking_and_the_answer_follows(thinking_stack, model_name, stream):
    base = thinking_stack.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = httpx.post(base + "/tokenize", json={"model": model_name, "messages": ASK}).json()["tokens"]
    thought_ids, thought = _ids(base, model_name, prompt, 4)
    close = httpx.post(base + "/tokenize", json={"model": model_name, "prompt": "\n</think>\n\n",
                                                 "add_special_tokens": False}).json()["tokens"]
    _, answer = _ids(base, model_name, prompt + thought_ids + close, 8)
    reply = client.chat.completions.create(model=model_name, messages=ASK, max_tokens=12, temperature=0,
                                           stream=stream, extra_body={"thinking_token_budget": 4})
    if stream:
        deltas = [c.choices[0].delta for c in reply if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        reasoning, content = reply.choices[0].message.reasoning_content, reply.choices[0].message.content
        assert reply.usage.completion_tokens == 12
    assert reasoning == thought + "\n" and content == "\n\n" + answer


@pytest.mark.stack
def test_structured_output_applies_after_the_thinking(thinking_stack, model_name):
    client = openai.OpenAI(base_url=thinking_stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model=model_name, messages=ASK, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        extra_body={"thinking_token_budget": 6})
    message = reply.choices[0].message
    assert message.reasoning_content and not message.reasoning_content.lstrip().startswith("{")
    assert set(json.loads(message.content)) == {"city"}  # the grammar held the answer, not the thinking
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget needs a reasoning parser"):
        client.chat.completions.create(model=model_name, messages=ASK, max_tokens=4,
                                       extra_body={"thinking_token_budget": 4,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
