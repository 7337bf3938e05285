"""response_format -> an llguidance grammar; the API validates with it, the worker decodes with it.

One function, so a schema the API accepts is exactly a schema the worker can compile.
"""

from __future__ import annotations

from functools import lru_cache

import llguidance

from shared.wire.messages import Guided, GuidedKind

# json.dumps' layout: no free whitespace, so a small model cannot wander off into blank lines
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidedError(ValueError):
    """The schema cannot be turned into a grammar; the message says why."""


@lru_cache(maxsize=64)
def grammar_for(guided: Guided) -> str:
    what = {GuidedKind.LARK: "grammar", GuidedKind.REGEX: "regex"}.get(guided.kind, "JSON schema")
    try:
        if guided.kind == GuidedKind.LARK:
            grammar = llguidance.LLMatcher.grammar_from_lark(guided.schema)
        elif guided.kind == GuidedKind.REGEX:
            grammar = llguidance.LLMatcher.grammar_from_regex(guided.schema)
        else:
            schema = {"type": "object"} if guided.kind == GuidedKind.JSON_OBJECT else guided.schema
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_LAYOUT)
    except ValueError as exc:
        raise GuidedError(f"invalid {what}: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GuidedError(f"invalid {what}: {messages[0]}")
    return grammar


def json_layout() -> dict:
    """The layout above, as a schema's x-guidance options (for schemas embedded in a Lark grammar)."""
    return dict(_JSON_LAYOUT)
