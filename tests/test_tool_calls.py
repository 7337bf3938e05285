"""Tool calling at the gateway without the stack: the parsers (whole and streamed in any split),
the grammar that forces a call (checked token by token on SmolLM2's tokenizer), tool_choice's
validation, and the Hermes template for ChatML models."""

from __future__ import annotations

import json

import llguidance
import pytest

from services.api.errors import APIError
from services.api.openai.body import validate
from services.api.openai.chat_template import render_chat
from services.api.openai.protocol import ChatCompletionRequest
from services.api.openai.tools.choice import forced_grammar, plan_tools
from services.api.openai.tools.parsers import HermesParser, JsonParser, MistralParser, resolve
from services.api.openai.tools.prompt import HERMES_CHATML, template_messages, template_tools
from shared.wire.guided import grammar_for

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def _parse_in_pieces(parser, text: str, size: int):
    content, calls = [], []
    for i in range(0, len(text), size):
        c, k = parser.feed(text[i : i + size])
        content.append(c)
        calls += k
    c, k = parser.finish()
    return "".join(content) + c, calls + k


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_parser_gives_the_same_calls_however_the_text_is_split(size):
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = _parse_in_pieces(HermesParser(), text, size)
    assert content == "Let me check. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_hermes_parser_keeps_what_is_not_a_call_as_content():
    assert _parse_in_pieces(HermesParser(), "a < b and <tool_call>{not json}</tool_call>", 2) == \
        ("a < b and <tool_call>{not json}</tool_call>", [])
    assert _parse_in_pieces(HermesParser(), 'cut <tool_call>\n{"name": "get_wea', 4) == \
        ('cut <tool_call>\n{"name": "get_wea', [])  # max_tokens ended it inside a block
    parser = HermesParser()
    assert parser.feed("text <tool_c") == ("text ", [])  # the tail that may open a block waits
    assert parser.finish() == ("<tool_c", [])


def test_json_parser_reads_a_call_or_a_list_of_calls():
    content, calls = _parse_in_pieces(JsonParser(), '[{"name": "get_time", "arguments": {"zone": "UTC"}}]', 5)
    assert content == "" and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert _parse_in_pieces(JsonParser(), "The answer is 4.", 5) == ("The answer is 4.", [])


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_mistral_parser_reads_both_of_its_call_formats(size):
    listed = 'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    content, calls = _parse_in_pieces(MistralParser(), listed, size)
    assert content == "Let me look. " and calls[0]["function"] == {"name": "get_weather",
                                                                   "arguments": '{"city": "Paris"}'}
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'
    assert [c["function"]["name"] for c in _parse_in_pieces(MistralParser(), v11, size)[1]] == ["get_weather",
                                                                                               "get_time"]
    assert _parse_in_pieces(MistralParser(), "No [TOOL_CALLS]{bad", size) == ("No [TOOL_CALLS]{bad", [])
    assert _parse_in_pieces(MistralParser(), "a [TOOL_C", size) == ("a [TOOL_C", [])  # cut short: text


def test_auto_picks_the_parser_the_chat_template_writes_calls_for():
    mistral = "{%- if message.tool_calls %}{{ '[TOOL_CALLS]' }}{{ message.tool_calls | tojson }}{%- endif %}"
    llama3 = "{%- if builtin_tools is defined or tools is not none %}<|python_tag|>{%- endif %}ipython"
    qwen = "{%- for tool_call in message.tool_calls %}<tool_call>\n{{ tool_call | tojson }}\n</tool_call>"
    chatml = "{% for message in messages %}<|im_start|>{{ message.role }}{% endfor %}"  # SmolLM2's: no tools
    assert [resolve("auto", t) for t in (mistral, llama3, qwen, chatml, None)] == \
        ["mistral", "json", "hermes", "hermes", "hermes"]
    assert resolve("json", qwen) == "json"  # a parser named is the one used


def test_tool_choice_is_validated_as_openai_does():
    with pytest.raises(APIError, match="'tool_choice' is only allowed when 'tools' are specified"):
        plan_tools(request(tool_choice="required"), "hermes")
    with pytest.raises(APIError, match="function 'nope' not found in 'tools'"):
        plan_tools(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "hermes")
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), "hermes") is None
    assert plan_tools(request(tools=[WEATHER]), "hermes").choice == "auto"
    assert forced_grammar(plan_tools(request(tools=[WEATHER]), "hermes")) is None  # auto: the model chooses


@pytest.fixture(scope="module")
def tokenizer():
    from shared.models.model_files import default_model_path
    from shared.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path()).tokenizer


def _accepts(tokenizer, guided, text: str) -> bool:
    lltok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=tokenizer.get_vocab_size(), eos_token=[2])
    matcher = llguidance.LLMatcher(lltok, grammar_for(guided), log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def test_a_forced_call_admits_only_the_allowed_functions_with_valid_arguments(tokenizer):
    named = forced_grammar(plan_tools(request(tools=[WEATHER, TIME],  # parallel_tool_calls is true by default
                                              tool_choice={"type": "function", "function": {"name": "get_time"}}),
                                      "hermes"))
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    assert _accepts(tokenizer, named, call)
    assert not _accepts(tokenizer, named, call.replace("get_time", "get_weather"))  # not the named one
    assert not _accepts(tokenizer, named, call.replace("CET", "PST"))  # outside the enum
    assert not _accepts(tokenizer, named, call + "\n" + call)  # a named function: one call
    assert not _accepts(tokenizer, named, call.replace('"CET"}', '"CET", "x": 1}'))  # additionalProperties
    required = forced_grammar(plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), "hermes"))
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _accepts(tokenizer, required, weather + "\n" + call)  # parallel: several
    assert not _accepts(tokenizer, required, "It is sunny.")  # required: a call, not text
    as_json = forced_grammar(plan_tools(request(tools=[TIME], tool_choice="required", parallel_tool_calls=False),
                                        "json"))
    assert _accepts(tokenizer, as_json, '{"name": "get_time", "arguments": {"zone": "UTC"}}')
    mistral = forced_grammar(plan_tools(request(tools=[TIME], tool_choice="required", parallel_tool_calls=False),
                                        "mistral"))
    assert _accepts(tokenizer, mistral, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert not _accepts(tokenizer, mistral, '[{"name": "get_time", "arguments": {"zone": "UTC"}}]')  # no marker


def test_the_hermes_template_renders_tools_calls_and_results():
    body = request(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    ])
    text = render_chat(HERMES_CHATML, template_messages(body.messages), bos_token="", eos_token="",
                       tools=template_tools(body.tools))
    assert text == (
        "<|im_start|>system\nBe brief.\n\nYou may call functions. Their signatures are inside <tools></tools>:\n"
        '<tools>\n{"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}\n</tools>\n'
        "To call a function, answer with a JSON object inside <tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function name>, "arguments": <arguments object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_only_calls_the_client_can_act_on_leave_the_text():
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    plan = plan_tools(request(tools=[strict, TIME]), "hermes")
    parser = HermesParser(plan.accepts)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>'  # strict: invalid
    invented = '<tool_call>\n{"name": "get_news", "arguments": {}}\n</tool_call>'  # not a declared function
    loose = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "PST"}}\n</tool_call>'  # not strict: as said
    content, calls = _parse_in_pieces(parser, good + bad + invented + loose, 5)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert content == bad + invented


def test_litellm_provider_fields_are_read_as_the_message_own_fields():
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "provider_specific_fields": {"refusal": "I cannot."}}]
    body = validate(ChatCompletionRequest, {"model": "m", "messages": history})
    assert body.messages[1].refusal == "I cannot." and body.messages[1].text() == "I cannot."
    history[1]["provider_specific_fields"] = {"refusal": None, "mood": "sunny"}
    body = validate(ChatCompletionRequest, {"model": "m", "messages": history})  # a message's own extra field:
    assert template_messages(body.messages)[1]["mood"] == "sunny"  # the chat template's to read, as in vLLM
