"""Chat templates rendered in jinja2's immutable sandbox (a template is untrusted input)."""

from __future__ import annotations

import json
from functools import lru_cache

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False) -> str:
    """As transformers' chat templates have it: plain JSON (jinja2's own escapes <, > and &)."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], *, bos_token: str | None, eos_token: str | None,
                add_generation_prompt: bool = True, **extra) -> str:
    try:
        return _compile(template).render(messages=messages, bos_token=bos_token or "", eos_token=eos_token or "",
                                         add_generation_prompt=add_generation_prompt, **extra)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
