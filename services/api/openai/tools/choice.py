"""What a chat request's `tools` and `tool_choice` ask of the engine, validated as OpenAI does.

- "none": the tools are left out of the prompt and the answer is text.
- "auto" (the default with tools): the model sees the tools and may call them; its text is parsed.
- "required", or a named function: the call is guaranteed by constrained decoding. A grammar in
  the tool-call parser's format admits only calls of the allowed functions whose arguments are
  valid against their JSON schemas, objects closed unless they say otherwise (xgrammar's strict
  mode, as vLLM has it), so even a small model returns a valid call; one cut short by max_tokens
  is neither a call nor content. A named function is called once;
  "required" may call several when parallel_tool_calls is true.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import jsonschema

from services.api.errors import APIError
from services.api.openai.protocol import ChatCompletionRequest, Tool
from shared.wire.guided import GuidedError, grammar_for, json_layout
from shared.wire.messages import Guided, GuidedKind

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"


@dataclass
class ToolPlan:
    tools: list[Tool]
    choice: str  # "auto", "required", or the one function's name
    parallel: bool
    parser: str  # "hermes" | "json" | "mistral" (auto resolved by the model's template)

    @property
    def is_forced(self) -> bool:
        return self.choice != "auto"

    @property
    def allows_several(self) -> bool:
        """A named function is called once (as OpenAI does); "required" may call several in parallel."""
        return self.parallel and self.choice == "required"

    def accepts(self, call: dict) -> bool:
        """A parsed call is one the client can act on: a declared function, and for a strict one
        arguments valid against its schema (a forced call is so by its grammar; under auto, checked)."""
        tool = next((t for t in self.tools if t.function.name == call["function"]["name"]), None)
        if tool is None:
            return False
        if not tool.function.strict:
            return True
        try:
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool.function.parameters)
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
            return False
        return True

    def allowed(self) -> list[Tool]:
        return self.tools if self.choice in ("auto", "required") else [t for t in self.tools if t.function.name == self.choice]


def plan_tools(body: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    """None when the answer is plain text (no tools, or tool_choice "none")."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                                "specified.", param="tool_choice")
        return None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools name a function twice: {names}", param="tools")
    if choice == "none":
        return None
    if choice is None or isinstance(choice, str):
        name = choice or "auto"
    else:
        name = choice.function.name
        if name not in names:
            raise APIError(400, f"Invalid value for 'tool_choice': function '{name}' not found in 'tools'.",
                           param="tool_choice")
    return ToolPlan(list(body.tools), name, body.parallel_tool_calls, parser)


def forced_grammar(plan: ToolPlan) -> Guided | None:
    """The grammar of the calls a forced plan allows, in the parser's format."""
    if not plan.is_forced:
        return None
    defs: dict = {}
    call = {"anyOf": [_call_schema(t, defs) for t in plan.allowed()], "x-guidance": json_layout()}
    if plan.parser == "hermes":
        block = "TC_OPEN call TC_CLOSE"
        start = f"start: {block} (\"\\n\" {block})*" if plan.allows_several else f"start: {block}"
        lark = "\n".join([start, f'TC_OPEN: "{TOOL_CALL_OPEN}\\n"', f'TC_CLOSE: "\\n{TOOL_CALL_CLOSE}"',
                          f"call: %json {json.dumps(_with_defs(call, defs))}", ""])
    else:  # json: the whole answer is a call, or a list of calls; mistral: always a list, after its marker
        schema = call
        if plan.allows_several or plan.parser == "mistral":
            schema = {"type": "array", "items": call, "minItems": 1, "x-guidance": json_layout()}
            if not plan.allows_several:
                schema["maxItems"] = 1
        body = f"%json {json.dumps(_with_defs(schema, defs))}"
        lark = f'start: "{MISTRAL_CALLS}" calls\ncalls: {body}\n' if plan.parser == "mistral" else f"start: {body}\n"
    guided = Guided(GuidedKind.LARK, lark)
    try:
        grammar_for(guided)
    except GuidedError as exc:
        raise APIError(400, f"the tools' parameters cannot be enforced: {exc}", param="tools") from None
    return guided


def _call_schema(tool: Tool, defs: dict) -> dict:
    arguments = _closed(_hoisted(tool.function.parameters, tool.function.name, defs))
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _closed(node):
    """Objects that do not say otherwise take no keys beyond their properties (xgrammar's strict
    mode, vLLM's default): a small model otherwise fills an open object until max_tokens."""
    if isinstance(node, list):
        return [_closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) if k != "const" and k != "enum" and k != "default" else v for k, v in node.items()}
    if "properties" in out and isinstance(out["properties"], dict):
        out["properties"] = {k: _closed(v) for k, v in node["properties"].items()}
    if (out.get("type") == "object" or "properties" in out) and not {"additionalProperties", "patternProperties",
                                                                      "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def _with_defs(schema: dict, defs: dict) -> dict:
    return {**schema, "$defs": {name: _closed(d) for name, d in defs.items()}} if defs else schema


def _hoisted(parameters: dict, name: str, defs: dict) -> dict:
    """A function's schema nested in the call's: its own `$defs` (or `definitions`) move to the
    root, renamed `<function>.<def>`, and its local `$ref`s follow them."""
    local = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    if not local:
        return parameters
    renames = {}
    for key in ("$defs", "definitions"):
        for def_name in parameters.get(key, {}):
            renames[f"#/{key}/{def_name}"] = f"#/$defs/{name}.{def_name}"

    def walk(node):
        if isinstance(node, dict):
            return {k: renames.get(v, v) if k == "$ref" and isinstance(v, str) else walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    for key in ("$defs", "definitions"):
        for def_name, schema in parameters.get(key, {}).items():
            defs[f"{name}.{def_name}"] = walk(schema)
    return walk({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")})
