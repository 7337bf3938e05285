"""Agent frameworks against the real stack: a LangGraph agent loop over two tools, and LiteLLM's
tool calls (whole and streamed) through its OpenAI and hosted_vllm providers."""

from __future__ import annotations

import copy
import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch its price list at import

import litellm  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import ToolNode, tools_condition  # noqa: E402

from tests.test_tool_calls import WEATHER  # noqa: E402

pytestmark = pytest.mark.stack


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"22 degrees and sunny in {city}"


@tool
def get_time(zone: str) -> str:
    """The time in a time zone, such as UTC or CET."""
    return f"12:00 in {zone}"


TOOLS = [get_weather, get_time]


def test_a_langgraph_agent_loop_calls_both_tools_then_answers(stack, model_name):
    """The agent node asks for each tool in turn by name (a 135M model would not pick them reliably on
    its own; a named tool_choice is grammar-bound), ToolNode runs them, and the loop ends on a plain
    answer once both results are in the history."""
    llm = ChatOpenAI(model=model_name, base_url=stack.base_url + "/v1", api_key="unused", temperature=0,
                     max_tokens=60, max_retries=0, timeout=120)

    def agent(state: MessagesState) -> dict:
        done = {m.name for m in state["messages"] if isinstance(m, ToolMessage)}
        todo = [t.name for t in TOOLS if t.name not in done]
        model = llm.bind_tools(TOOLS, tool_choice=todo[0] if todo else "none")
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(TOOLS))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    graph.add_edge("tools", "agent")
    final = graph.compile().invoke({"messages": [HumanMessage("What are the weather and the time in Paris?")]},
                                   {"recursion_limit": 10})
    messages = final["messages"]
    calls = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert [r.tool_call_id for r in results] == [c["id"] for c in calls]
    assert results[0].content.startswith("22 degrees") and results[1].content.startswith("12:00")
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls and messages[-1].content


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_tool_calls_whole_and_streamed(stack, model_name, provider):
    common = {"model": f"{provider}/{model_name}", "api_base": stack.base_url + "/v1", "api_key": "unused",
              "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
              "tools": [copy.deepcopy(WEATHER)],  # LiteLLM edits the schema in place (drops additionalProperties)
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0,
              "max_tokens": 60}
    whole = litellm.completion(**common)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert whole.choices[0].finish_reason == "tool_calls"
    chunks = list(litellm.completion(**common, stream=True))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=common["messages"])
    (streamed,) = rebuilt.choices[0].message.tool_calls
    assert streamed.function.name == "get_weather" and streamed.function.arguments == call.function.arguments
    follow = litellm.completion(**{**common, "tool_choice": "auto", "messages": [
        *common["messages"], whole.choices[0].message,  # as LiteLLM's docs append it
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]})
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls
