"""Reading a request body: a size limit (413), JSON (400), per-model defaults, then validation (400).

Per-model OpenAI defaults (completion_config / chat_completion_config) fill in the fields a
request leaves out, so they go in before validation: a default is held to the same rules.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import msgspec
from fastapi import Request
from pydantic import BaseModel, ValidationError

from services.api.context import ApiContext, ServedModel
from services.api.errors import APIError
from services.api.openai.generation import RETRY_AFTER_S

Body = TypeVar("Body", bound=BaseModel)


async def read_json(request: Request, max_bytes: int, allow_list: bool = False) -> dict | list:
    """The body, read once per request (a route that dispatches on it hands the same to the next)."""
    if (read := getattr(request.state, "json_body", None)) is not None:
        return read
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body is over the limit of {max_bytes} bytes")
        chunks.append(chunk)
    raw = decode_json(b"".join(chunks), "the request body")
    if not isinstance(raw, dict) and not (allow_list and isinstance(raw, list)):
        raise APIError(400, "the request body must be a JSON object")
    request.state.json_body = raw
    return raw


MAX_JSON_DEPTH = 64  # objects and arrays inside one another; deeper is refused before anything walks it


def decode_json(data: bytes | str, what: str, param: str | None = None):
    """JSON, or a 400 that says why: not JSON, not UTF-8, or nested deeper than MAX_JSON_DEPTH."""
    too_deep = APIError(400, f"{what} nests objects and arrays more than {MAX_JSON_DEPTH} deep", param=param)
    try:
        value = msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise APIError(400, f"{what} is not valid JSON (UTF-8)", param=param) from None
    except RecursionError:
        raise too_deep from None
    deep, huge = _shape(value)
    if deep:
        raise too_deep
    if huge and (path := _huge_int(value)) is not None:  # nothing downstream (msgpack, torch) takes them
        raise APIError(400, f"{path or what}: integers must fit in 64 bits: Input should be less than or equal to "
                            f"{2**63 - 1} and greater than or equal to {-(2**63)} [type=less_than_equal]",
                       param=path or param)  # pydantic's words, as vLLM's seed bound gives them
    return value


def _huge_int(value, path: str = "") -> str | None:
    """The path of the first integer outside int64 (walked only when `_shape` found one)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return path if not -(2**63) <= value < 2**63 else None
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        if (found := _huge_int(child, f"{path}.{key}" if path and isinstance(key, str) else
                               f"{path}[{key}]" if isinstance(key, int) else str(key))) is not None:
            return found
    return None


def _shape(value) -> tuple[bool, bool]:
    """(nested past MAX_JSON_DEPTH, holds an integer outside int64), in one walk of the body."""
    stack, huge = [(value, 1)], False
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                return True, huge
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
        elif isinstance(item, int) and not -(2**63) <= item < 2**63:
            huge = True
    return False, huge


def served_model(ctx: ApiContext, raw: dict) -> ServedModel | None:
    """The model a body names: 404 if it names one we do not serve, None if it names none."""
    name = raw.get("model")
    if not isinstance(name, str):
        return None  # validation reports the missing or mistyped field
    model = ctx.resolve(name)
    if model is not None:
        return model
    if ctx.is_pending(name):
        raise APIError(503, f"The model `{name}` is deployed but not ready yet.", param="model",
                       code="model_not_ready")
    raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


async def parse(request: Request, cls: type[Body], defaults_of=None,
                model_name: str | None = None) -> tuple[ApiContext, ServedModel, Body]:
    """The body of a request naming a model: read, model looked up, defaults filled in, validated.

    defaults_of: for the OpenAI routes, which of the model's OpenAI defaults apply
    (e.g. lambda m: m.openai.chat); such a route answers 404 where the model's OpenAI API is off.
    model_name: the model the route's path names; it takes the place of the body's `model`.
    """
    ctx: ApiContext = request.app.state.ctx
    raw = await read_json(request, ctx.server.max_body_bytes)
    name = raw.get("model")
    if isinstance(name, str) and name and ctx.limits is not None and ctx.resolve(name) is None \
            and not ctx.is_pending(name):  # an adapter of a model whose scheduler we have not heard from?
        bases = list(ctx.models.values()) if model_name is None else [m for m in [ctx.resolve(model_name)] if m]
        await _learn_adapters(ctx, name, bases)
    if model_name is not None and not _adapter_of(ctx, raw.get("model"), model_name):
        raw["model"] = model_name  # the route's model, unless the body names one of its LoRA adapters
    elif raw.get("model") in (None, "") and ctx.models:  # vLLM's rule: no name is the stack's own model
        raw["model"] = next(iter(ctx.models))
    model = served_model(ctx, raw)
    if model is not None and not model.max_model_len and ctx.limits is not None:
        await ctx.limits.refresh(model.engine)  # its workers joined before the scheduler's word reached us
        model = served_model(ctx, raw)  # an adapter's view copies its base's limits
    if defaults_of is not None and model is not None and not model.openai.enabled:
        raise APIError(404, f"The OpenAI API is not enabled for model `{model.name}`.", param="model",
                       code="openai_not_enabled")
    body = validate(cls, raw, defaults_of(model) if model is not None and defaults_of else None)
    return ctx, model, body  # validation requires `model`, so model is set here


async def _learn_adapters(ctx: ApiContext, name: str, models: list[ServedModel]) -> None:
    """A name we do not know may be a LoRA adapter of one of `models` whose scheduler we have not heard
    from (this gateway started while it was silent): ask those schedulers; 503 while any stays unknown."""
    unknown = [m for m in models if not m.max_model_len]
    if not unknown:
        return  # their schedulers' word is in: the name is none of their adapters
    await asyncio.gather(*(ctx.limits.refresh(engine) for engine in {m.engine for m in unknown}))
    if ctx.resolve(name) is None and any(not m.max_model_len for m in unknown):  # apply() sets them in place
        raise APIError(503, f"The model `{name}` is not known to this gateway, which has not heard yet which "
                            "adapters its engines serve; retry shortly.", param="model", code="engine_unavailable",
                       headers={"Retry-After": RETRY_AFTER_S})


def _adapter_of(ctx: ApiContext, name, model_name: str) -> bool:
    base = ctx.resolve(model_name)
    return isinstance(name, str) and base is not None and any(info.name == name for info in base.loras)


def validate(cls: type[Body], raw: dict, defaults: dict | None = None) -> Body:
    try:
        body = cls.model_validate({**(defaults or {}), **raw})
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    if (unknown := unrecognized(body)) is not None:  # a field accepted and ignored would be a defect
        raise APIError(400, f"Unrecognized request argument supplied: {unknown}", param=unknown,
                       code="unrecognized_argument")
    return body


def unrecognized(value, path: str = "") -> str | None:
    """The first field, anywhere in the body, that no model declares and that is not null."""
    if isinstance(value, BaseModel):
        for name, extra in (value.model_extra or {}).items():
            if extra is not None and not getattr(value, "extra_is_template_context", False):
                return f"{path}{name}"
        for name in type(value).model_fields:
            if (found := unrecognized(getattr(value, name), f"{path}{name}.")) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := unrecognized(item, f"{path.rstrip('.')}[{i}].")) is not None:
                return found
    return None


def validation_error(errors: list) -> APIError:
    first = errors[0] if errors else {}
    # a union's branch is named in the path by its type ("list[...]"): left out, the path is the body's
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and "[" not in str(p)]
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message = "the request body is not valid JSON"
    elif first.get("type"):
        message += f" [type={first['type']}]"  # pydantic's error type, which vLLM's messages carry
    param = ".".join(loc) or None
    return APIError(400, f"{param + ': ' if param else ''}{message}", param=param)
