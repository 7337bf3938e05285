"""Showing a model its tools: the chat messages (tool calls and results included) as template
input, and a Hermes-style template for ChatML models whose own template has no tools.

A model's own template is used when it renders `tools` (Qwen's, Hermes', Llama 3.1's do); a
ChatML template that does not (SmolLM2's) gets HERMES_CHATML below, which lists the tools'
signatures in the system turn, writes past calls as <tool_call> blocks and tool results as
<tool_response> blocks in a user turn, the format the hermes parser reads back. Any other
template that cannot render tools is a 400 that says how to supply one.
"""

from __future__ import annotations

import json

from services.api.errors import APIError
from services.api.openai.protocol import ChatMessage, TextPart, Tool

HERMES_CHATML = """\
{%- set system = messages[0].content if messages and messages[0].role in ('system', 'developer') else none %}
{%- if tools %}
<|im_start|>system
{% if system %}{{ system }}

{% endif %}You may call functions. Their signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}</tools>
To call a function, answer with a JSON object inside <tool_call></tool_call> tags:
<tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif system %}
<|im_start|>system
{{ system }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if loop.first and system %}
{%- elif message.role == 'assistant' %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{% for call in message.tool_calls or [] %}
{% if not loop.first or message.content %}

{% endif %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments }}}
</tool_call>
{% endfor %}
<|im_end|>
{% elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """As chat templates expect them: text content, and tool calls with their fields."""
    out = []
    for m in messages:
        message = {**(m.model_extra or {}), "role": m.role, "content": _content(m)}  # extras: the template's to read
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type,
                                      "function": {"name": c.function.name,
                                                   "arguments": c.function.arguments or "{}"}}  # "": no arguments
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _content(m: ChatMessage) -> str | list[dict]:
    """Text; with images, the parts in order as Hugging Face templates read them ({"type": "image"}
    where the template writes the model's placeholder)."""
    if not m.images():
        return m.text()
    return [{"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"} for part in m.content]


def uses_tools(messages: list[ChatMessage], tools: list[Tool] | None) -> bool:
    return bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages)


def tool_template(model_template: str) -> str:
    """The template that can render this request's tools: the model's own, or HERMES_CHATML."""
    if "tools" in model_template:
        return model_template
    if "<|im_start|>" in model_template:
        return HERMES_CHATML
    raise APIError(400, "this model's chat template cannot render tools or tool messages: give one that can "
                        "(the model's OpenAI config's chat_template)", param="tools")


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    return [json.loads(t.model_dump_json(exclude_none=True)) for t in tools] if tools else None
