"""What vLLM's own OpenAI-server tests check of tool use (tests/entrypoints/openai/chat_completion/
test_completion_with_function_calling.py), asked of a Switchyard stack in our own tests: nested
schemas with $defs, every tool_choice streamed and not, tools without arguments in the history, a
named call that fits its schema, inconsistent tool_choice refused, and a 1-token budget.
docs/vllm_compat.md lists the test files and where we differ."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.stack
UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER = {"type": "function", "function": {"name": "get_current_weather", "description": "Current weather", "parameters": {
    "type": "object", "strict": True, "required": ["country", "unit"],
    "properties": {"city": {"type": "string", "default": "Vienna"}, "country": {"type": "string"}, "unit": UNIT,
                   "options": {"$ref": "#/$defs/Options"}},
    "$defs": {"Options": {"type": "object", "additionalProperties": False, "properties": {
        "unit": UNIT, "include_forecast": {"type": "boolean", "default": False}}}}}}}
FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "required": ["country", "days", "unit"],
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "days": {"type": "integer"},
                   "unit": UNIT}}}}
ASK = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
       {"role": "user", "content": "What is the weather in Berlin, and the forecast for 5 days, in fahrenheit?"}]
PROFILE = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
           "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 18,
                                                                              "maximum": 99}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_current_weather"}}])
def test_forced_calls_with_nested_schemas_whole_and_streamed(openai_client, model_name, stream, tool_choice):
    reply = openai_client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER, FORECAST],
                                                  tool_choice=tool_choice, max_tokens=200, temperature=0, stream=stream)
    if not stream:
        calls = reply.choices[0].message.tool_calls
        assert calls and reply.choices[0].finish_reason == "tool_calls"
        arguments = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    else:
        chunks = list(reply)
        assert sum(c.choices[0].finish_reason is not None for c in chunks if c.choices) == 1
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        names, texts = {}, {}
        for d in deltas:
            names[d.index] = names.get(d.index) or (d.function.name if d.function else None)
            texts[d.index] = texts.get(d.index, "") + (d.function.arguments or "" if d.function else "")
        arguments = [(names[i], json.loads(texts[i])) for i in sorted(names)]
    for name, args in arguments:
        schema = (WEATHER if name == "get_current_weather" else FORECAST)["function"]["parameters"]
        jsonschema.validate(args, {k: v for k, v in schema.items() if k != "strict"})


@pytest.mark.parametrize("arguments", ["{}", ""])
def test_a_tool_without_arguments_round_trips(openai_client, model_name, arguments):
    now = {"type": "function", "function": {"name": "get_current_time", "description": "The time now",
                                            "parameters": {"type": "object", "properties": {}, "required": []}}}
    messages = [{"role": "user", "content": "What time is it?"}]
    first = openai_client.chat.completions.create(model=model_name, messages=messages, tools=[now],
                                                  tool_choice="required", temperature=0, seed=42, max_tokens=40)
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_current_time" and json.loads(call.function.arguments) == {}
    call.function.arguments = arguments  # a client may send back either
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    final = openai_client.chat.completions.create(model=model_name, messages=messages, temperature=0,
                                                  max_completion_tokens=40)
    assert final.choices[0].message.content and final.choices[0].message.content.strip()


def test_a_named_call_fits_its_schema_and_streams_only_arguments(openai_client, model_name):
    tools = [{"type": "function", "function": {"name": "dummy_function_name", "parameters": PROFILE}}]
    choice = {"type": "function", "function": {"name": "dummy_function_name"}}
    messages = [{"role": "user", "content": "Give an example employee profile."}]
    whole = openai_client.chat.completions.create(model=model_name, messages=messages, tools=tools, tool_choice=choice,
                                                  temperature=0, max_completion_tokens=200)
    message = whole.choices[0].message
    assert not message.content  # OpenAI's null (vLLM's own test expects "")
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), PROFILE)
    pieces, finishes = [], 0
    for chunk in openai_client.chat.completions.create(model=model_name, messages=messages, tools=tools,
                                                       tool_choice=choice, temperature=0, max_completion_tokens=200,
                                                       stream=True):
        delta = chunk.choices[0].delta
        assert delta.role in (None, "assistant") and not delta.content
        if delta.tool_calls and delta.tool_calls[0].function.arguments:
            pieces.append(delta.tool_calls[0].function.arguments)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and json.loads("".join(pieces)) == json.loads(message.tool_calls[0].function.arguments)


def test_inconsistent_tool_choice_is_refused_and_one_token_does_not_crash(openai_client, model_name):
    tools = [{"type": "function", "function": {"name": "dummy_function_name", "parameters": PROFILE}}]
    named = {"type": "function", "function": {"name": "dummy_function_name"}}
    common = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 20}
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(**common, tool_choice=named)
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(**common, tools=tools, tool_choice={
            "type": "function", "function": {"name": "nondefined_function_name"}})
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(**common, tools=tools, tool_choice={})
    for choice in ("required", named):
        reply = openai_client.chat.completions.create(**{**common, "max_completion_tokens": 1}, tools=tools,
                                                      tool_choice=choice, temperature=0)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "length" and not message.tool_calls and not message.content
