"""Chat templates rendered in jinja2's immutable sandbox, with limits (a template is untrusted input).

A render may run for RENDER_TIMEOUT_S, iterate ranges MAX_LOOP_ITERATIONS times in all, build no
string or list longer than MAX_OUTPUT_CHARS, and produce at most that much text; a template that
breaks a limit, or fails in any way (include, import, a bad filter), is the request's error (400).
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from functools import lru_cache

from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIMEOUT_S = 2.0
MAX_LOOP_ITERATIONS = 1_000_000
MAX_OUTPUT_CHARS = 4 * 2**20
_TEMPLATE_FILE = "<template>"  # the filename jinja2 gives code compiled from a string


class ChatTemplateError(ValueError):
    pass


class _Limits(threading.local):
    deadline = 0.0
    iterations = 0


_limits = _Limits()


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False) -> str:
    """As transformers' chat templates have it: plain JSON (jinja2's own escapes <, > and &)."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _range(*args):
    """range(), counting every iteration of the render against MAX_LOOP_ITERATIONS."""
    for i in range(*args):
        _limits.iterations += 1
        if _limits.iterations > MAX_LOOP_ITERATIONS:
            raise SecurityError(f"the template loops more than {MAX_LOOP_ITERATIONS} times")
        yield i


def _check_size(value):
    if isinstance(value, str | list | tuple | dict) and len(value) > MAX_OUTPUT_CHARS:
        raise SecurityError(f"the template builds a value longer than {MAX_OUTPUT_CHARS}")
    return value


def _check_args(args, kwargs) -> None:
    """An integer argument past the output limit (a width, a count) is refused before the call allocates."""
    if any(isinstance(a, int) and abs(a) > MAX_OUTPUT_CHARS for a in (*args, *kwargs.values())):
        raise SecurityError(f"the template passes a number above {MAX_OUTPUT_CHARS}")


def _limited(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _check_args(args, kwargs)
        return _check_size(fn(*args, **kwargs))
    return call


def _str_join(seq) -> str:
    """`a ~ b`, with the output limit."""
    parts = [str(x) for x in seq]
    if sum(map(len, parts)) > MAX_OUTPUT_CHARS:
        raise SecurityError(f"the template builds a value longer than {MAX_OUTPUT_CHARS}")
    return "".join(parts)


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def call(self, __context, __obj, *args, **kwargs):
        _check_args(args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise SecurityError("the template raises to a power above 64")
        if operator == "*":
            sized, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(times, int) and hasattr(sized, "__len__") and len(sized) * times > MAX_OUTPUT_CHARS:
                raise SecurityError(f"the template builds a value longer than {MAX_OUTPUT_CHARS}")
        if operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__") \
                and len(left) + len(right) > MAX_OUTPUT_CHARS:
            raise SecurityError(f"the template builds a value longer than {MAX_OUTPUT_CHARS}")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=16)
def _compile(template: str):
    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = _range
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited(f) for name, f in env.filters.items()}
    compiled = env.from_string(template)
    compiled.root_render_func.__globals__["str_join"] = _str_join  # the code's `~`
    compiled.root_render_func.__globals__["markup_join"] = _str_join
    return compiled


def _trace(frame, event, arg):
    """Only the template's own code is traced, line by line, against the render's deadline."""
    if frame.f_code.co_filename != _TEMPLATE_FILE:
        return None
    return _check_deadline


def _check_deadline(frame, event, arg):
    if time.monotonic() > _limits.deadline:
        raise SecurityError(f"the template ran longer than {RENDER_TIMEOUT_S}s")
    return _check_deadline


def render_chat(template: str, messages: list[dict], *, bos_token: str | None, eos_token: str | None,
                add_generation_prompt: bool = True, **extra) -> str:
    """Call it off the event loop (services/api/off_loop.py): a render may take RENDER_TIMEOUT_S."""
    try:
        compiled = _compile(template)
    except Exception as exc:  # a syntax error, an unknown tag
        raise ChatTemplateError(f"chat template failed: {exc}") from None
    _limits.deadline, _limits.iterations = time.monotonic() + RENDER_TIMEOUT_S, 0
    previous = sys.gettrace()
    sys.settrace(_trace)
    try:
        parts, size = [], 0
        for part in compiled.generate(messages=messages, bos_token=bos_token or "", eos_token=eos_token or "",
                                      add_generation_prompt=add_generation_prompt, **extra):
            size += len(part)
            if size > MAX_OUTPUT_CHARS:
                raise SecurityError(f"the template's output is longer than {MAX_OUTPUT_CHARS} characters")
            parts.append(part)
        return "".join(parts)
    except Exception as exc:  # the template's own failure, or a limit: the request's error, never a 500
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.settrace(previous)
