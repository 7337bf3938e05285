"""Tool calling end to end with the official `openai` client, against real services and SmolLM2:
forced calls valid against their schemas (constrained decoding), streamed as OpenAI streams them,
tool results in the history, and OpenAI's 400s."""

from __future__ import annotations

import json

import openai
import pytest

from tests.test_tool_calls import TIME, WEATHER

pytestmark = pytest.mark.stack
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_tool_choice_returns_a_valid_call(openai_client, model_name):
    r = openai_client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER, TIME],
                                              tool_choice=NAMED, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)


def test_required_picks_one_of_the_tools_and_sampling_keeps_it_valid(openai_client, model_name):
    for seed in range(3):
        r = openai_client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER, TIME],
                                                  tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                                  temperature=1.0, seed=seed)
        (call,) = r.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_time":
            assert arguments["zone"] in ("UTC", "CET")
        else:
            assert call.function.name == "get_weather" and isinstance(arguments["city"], str)
        assert r.choices[0].finish_reason == "tool_calls"


def test_a_streamed_call_sends_id_and_name_first_then_the_arguments(openai_client, model_name):
    whole = openai_client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                                  max_tokens=60, temperature=0)
    chunks = list(openai_client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER],
                                                        tool_choice=NAMED, max_tokens=60, temperature=0, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first, second = deltas[0][0], deltas[1][0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert first.function.arguments == "" and second.id is None and second.function.name is None
    assert second.function.arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_tool_result_in_the_history_is_answered(openai_client, model_name):
    first = openai_client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                                  max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    r = openai_client.chat.completions.create(model=model_name, messages=history, tools=[WEATHER], max_tokens=30,
                                              temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    plain = openai_client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER], tool_choice="none",
                                                  max_tokens=10, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_tool_choice_errors_are_openais(openai_client, model_name):
    with pytest.raises(openai.BadRequestError, match="function 'get_time' not found in 'tools'"):
        openai_client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER],
                                              tool_choice={"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(openai.BadRequestError, match="'tool_choice' is only allowed when 'tools' are specified"):
        openai_client.chat.completions.create(model=model_name, messages=ASK, tool_choice="required")
