"""The Responses API through the openai SDK's own client and types, against the real stack: plain
and streamed (events in order), a function tool, structured text, stored and chained."""

from __future__ import annotations

import json

import openai
import pytest

from tests.test_tool_calls import WEATHER

pytestmark = pytest.mark.stack
TOOL = {"type": "function", **WEATHER["function"]}


def test_a_plain_response_and_its_stored_copy(openai_client, model_name):
    r = openai_client.responses.create(model=model_name, input="What is the capital of France?",
                                       instructions="Answer in one sentence.", max_output_tokens=30, temperature=0)
    assert r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    assert r.output[0].type == "message" and r.output_text and "Paris" in r.output_text
    assert r.usage.output_tokens <= 30 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    stored = openai_client.responses.retrieve(r.id)
    assert stored.output_text == r.output_text and stored.instructions == "Answer in one sentence."
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve("resp_" + "0" * 32)


def test_a_streamed_response_sends_the_events_in_order(openai_client, model_name):
    whole = openai_client.responses.create(model=model_name, input="Say hello.", max_output_tokens=12, temperature=0)
    events = list(openai_client.responses.create(model=model_name, input="Say hello.", max_output_tokens=12,
                                                 temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_a_function_tool_then_its_output_chained_by_previous_response_id(openai_client, model_name):
    first = openai_client.responses.create(model=model_name, input="What is the weather in Paris?", tools=[TOOL],
                                           tool_choice={"type": "function", "name": "get_weather"},
                                           max_output_tokens=60, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    second = openai_client.responses.create(
        model=model_name, previous_response_id=first.id, tools=[TOOL], max_output_tokens=20, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees and sunny"}])
    assert second.previous_response_id == first.id and second.output_text
    streamed = list(openai_client.responses.create(model=model_name, input="What is the weather in Paris?",
                                                   tools=[TOOL], tool_choice="required", max_output_tokens=60,
                                                   temperature=0, stream=True))
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert streamed[-1].response.output[0].type == "function_call"


def test_structured_text_and_refusals(openai_client, model_name):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    r = openai_client.responses.create(model=model_name, input="Name a city.", max_output_tokens=30, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["city"], str)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
        openai_client.responses.create(model=model_name, input="hi", previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError, match="background responses are not supported"):
        openai_client.responses.create(model=model_name, input="hi", background=True)
