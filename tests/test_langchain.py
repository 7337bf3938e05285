"""LangChain's OpenAI chat model against the real stack: bind_tools with a tool round trip, and
with_structured_output(method="function_calling"), on SmolLM2 (forced calls are grammar-bound)."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

pytestmark = pytest.mark.stack


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"22 degrees and sunny in {city}"


class Capital(BaseModel):
    """A country and its capital."""

    country: str
    capital: str


@pytest.fixture(scope="module")
def llm(stack, model_name):
    return ChatOpenAI(model=model_name, base_url=stack.base_url + "/v1", api_key="unused", temperature=0,
                      max_tokens=60, max_retries=0, timeout=120)


def test_bind_tools_and_a_tool_round_trip(llm):
    ask = HumanMessage("What is the weather in Paris?")
    first = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([ask])
    (call,) = first.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"].startswith("call_")
    result = get_weather.invoke(call["args"])
    answer = llm.bind_tools([get_weather]).invoke([ask, first, ToolMessage(result, tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls


def test_structured_output_by_function_calling(llm):
    capital = llm.with_structured_output(Capital, method="function_calling").invoke("The capital of France is Paris.")
    assert isinstance(capital, Capital) and capital.country and capital.capital
