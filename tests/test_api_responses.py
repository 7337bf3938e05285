"""The Responses API through the openai SDK's own client and types, against the real stack: plain
and streamed (events in order), a function tool, structured text, stored and chained."""

from __future__ import annotations

import json
import time

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
    unstored = openai_client.responses.create(model=model_name, input="Hello!", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError, match="Response with id .* not found"):
        openai_client.responses.retrieve(unstored.id)


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
    with pytest.raises(openai.BadRequestError, match="stream"):
        openai_client.responses.create(model=model_name, input="hi", background=True, stream=True)


def _settled(client, response_id: str, timeout: float = 120.0):
    """Polled as a client must: a background response has no push."""
    deadline = time.monotonic() + timeout
    while (r := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, r
        time.sleep(0.1)
    return r


def test_a_background_response_is_answered_after_the_post_and_can_be_cancelled(openai_client, model_name):
    foreground = openai_client.responses.create(model=model_name, input="Say hello.", max_output_tokens=12,
                                                temperature=0)
    queued = openai_client.responses.create(model=model_name, input="Say hello.", max_output_tokens=12,
                                            temperature=0, background=True)
    assert queued.status == "queued" and queued.background and not queued.output
    done = _settled(openai_client, queued.id)
    assert done.status == foreground.status and done.output_text == foreground.output_text and done.usage
    assert openai_client.responses.cancel(done.id).status == done.status  # finished: returned as it is
    # a long answer (a schema that needs 4,000 characters), cancelled while it runs
    story = {"type": "json_schema", "name": "story", "schema": {
        "type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"]}}
    long = openai_client.responses.create(model=model_name, input="Tell a long story.", max_output_tokens=1000,
                                          text={"format": story}, background=True)
    cancelled = openai_client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 1000
    assert openai_client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        openai_client.responses.cancel(foreground.id)
    with pytest.raises(openai.BadRequestError, match="store"):
        openai_client.responses.create(model=model_name, input="Hi", background=True, store=False)


def test_output_text_logprobs_when_included(openai_client, model_name):
    r = openai_client.responses.create(model=model_name, input="What is 13 * 24?", max_output_tokens=8, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=3)
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens and all(len(lp.top_logprobs) == 3 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs).startswith(part.text[:5])
    events = list(openai_client.responses.create(model=model_name, input="What is 13 * 24?", max_output_tokens=8,
                                                 temperature=0, include=["message.output_text.logprobs"],
                                                 top_logprobs=3, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    with pytest.raises(openai.BadRequestError, match="include"):
        openai_client.responses.create(model=model_name, input="Hi", include=["file_search_call.results"])


def test_model_may_be_left_out_when_one_model_is_served(openai_client, model_name):
    """vLLM's rule: the one model the gateway serves; with several, OpenAI's required field."""
    if len(openai_client.models.list().data) == 1:
        r = openai_client.responses.create(input="Hello!", max_output_tokens=4)
        assert r.model == model_name and r.status in ("completed", "incomplete")
    else:
        with pytest.raises(openai.BadRequestError, match="model"):
            openai_client.responses.create(input="Hello!", max_output_tokens=4)
