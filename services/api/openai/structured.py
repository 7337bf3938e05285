"""Constrained output however a request asks for it: OpenAI's response_format, vLLM's guided_json,
guided_choice, guided_regex, guided_grammar and structured_outputs. At most one per request; each
becomes a Guided spec that the API compiles once (a bad one is a 400) and the worker decodes by."""

from __future__ import annotations

import json

from services.api.errors import APIError
from services.api.openai.protocol import _Sampling
from shared.wire.guided import GuidedError, grammar_for
from shared.wire.messages import Guided, GuidedKind


def _json_schema(schema: dict | str, param: str) -> Guided:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise APIError(400, f"{param} is not valid JSON: {exc}", param=param) from None
    return Guided(GuidedKind.JSON_SCHEMA, json.dumps(schema))


def _choice(choices: list[str]) -> Guided:
    """Exactly one of the strings (json.dumps quotes them as Lark string literals)."""
    return Guided(GuidedKind.LARK, "start: " + " | ".join(json.dumps(c) for c in choices) + "\n")


def _asked(body: _Sampling) -> list[tuple[str, Guided]]:
    asked = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", Guided(GuidedKind.JSON_OBJECT)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs a json_schema",
                           param="response_format.json_schema")
        asked.append(("response_format", _json_schema(fmt.json_schema.schema_, "response_format")))
    if body.guided_json is not None:
        asked.append(("guided_json", _json_schema(body.guided_json, "guided_json")))
    if body.guided_choice is not None:
        asked.append(("guided_choice", _choice(body.guided_choice)))
    if body.guided_regex is not None:
        asked.append(("guided_regex", Guided(GuidedKind.REGEX, body.guided_regex)))
    if body.guided_grammar is not None:
        asked.append(("guided_grammar", Guided(GuidedKind.LARK, body.guided_grammar)))
    so = body.structured_outputs
    if so is not None:
        for name, value, make in (("json", so.json_, lambda v: _json_schema(v, "structured_outputs.json")),
                                  ("regex", so.regex, lambda v: Guided(GuidedKind.REGEX, v)),
                                  ("choice", so.choice, _choice), ("grammar", so.grammar, lambda v: Guided(GuidedKind.LARK, v)),
                                  ("json_object", so.json_object or None, lambda _: Guided(GuidedKind.JSON_OBJECT))):
            if value is not None:
                asked.append((f"structured_outputs.{name}", make(value)))
    return asked


def guided(body: _Sampling) -> Guided | None:
    asked = _asked(body)
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"give at most one constraint on the output, got {', '.join(n for n, _ in asked)}",
                       param=asked[1][0])
    param, spec = asked[0]
    try:
        grammar_for(spec)
    except GuidedError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
    return spec
