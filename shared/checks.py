"""The field checks every configuration object uses, so a bad value reads the same from a flag or an upload."""

from __future__ import annotations

import json

import msgspec

MAX_CONTEXT = 1 << 20


class ConfigError(ValueError):
    """A configuration value a user must fix; the message says which and why."""


def in_range(field: str, value, low, high=None, allow_none: bool = False) -> None:
    """low <= value <= high; no `high`: low or more."""
    if value is None and allow_none:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value < low
            or (high is not None and value > high)):
        allowed = f"{low} or more" if high is None else f"{low} to {high}"
        raise ConfigError(f"{field} = {value!r} is out of range: allowed {allowed}"
                          + (" (or null)" if allow_none else ""))


def _choices(allowed: tuple) -> str:
    names = [repr(a) for a in allowed]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def one_of(field: str, value, allowed: tuple, refused: tuple = (), why: str = "") -> None:
    if value in refused:
        raise ConfigError(f"{field} = {value!r} is not supported {why}: allowed {_choices(allowed)}")
    if isinstance(value, bool) or value not in allowed:
        raise ConfigError(f"{field} = {value!r} is not allowed: allowed {_choices(allowed)}")


def is_bool(field: str, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{field} = {value!r} must be true or false")


def json_object(name: str, value: str | dict, example: str) -> dict:
    """A flag's JSON text or a deployment's dict, as a dict; anything else a ConfigError naming `name`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, e.g. {example}")
    return value


def struct_of(name: str, value: dict, kind: type):
    """`value` as the msgspec struct `kind`; a wrong or unknown key is a ConfigError listing the keys taken."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{name}: {exc} (keys taken here: {', '.join(kind.__struct_fields__)})") from None
