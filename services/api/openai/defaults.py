"""Per-model OpenAI defaults (the seed product's OpenaiConfig): completion_config and
chat_completion_config, whose values apply when a request leaves the field out.

Every key must be a request field (or chat_template for chat); anything else is refused by name,
so a default can never be accepted and ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from pydantic import ValidationError

from services.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from shared.config import ConfigError

# what a default may not set: what the request is, not how it samples
_PER_REQUEST = {"model", "prompt", "messages", "stream", "stream_options", "user"}


@dataclass
class OpenaiDefaults:
    enabled: bool = True  # False: the model does not answer on the OpenAI routes
    completion: dict = field(default_factory=dict)
    chat: dict = field(default_factory=dict)
    chat_template: str | None = None


def load_openai_config(value: str | None) -> OpenaiDefaults:
    """`value` is JSON or a path to a JSON file."""
    if not value:
        return OpenaiDefaults()
    text = open(value).read() if os.path.exists(value) else value
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"openai_config is not valid JSON: {exc}") from None
    return openai_defaults_from(config)


def openai_defaults_from(config: object) -> OpenaiDefaults:
    """A decoded openai_config (the flag's JSON, or the one `configure` stored), checked key by key."""
    if not isinstance(config, dict):
        raise ConfigError("openai_config must be a JSON object")
    unknown = set(config) - {"enabled", "completion_config", "chat_completion_config"}
    if unknown:
        raise ConfigError(f"openai_config has unknown keys {sorted(unknown)}; "
                          "allowed: enabled, completion_config, chat_completion_config")
    enabled = config.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"openai_config.enabled must be true or false, got {enabled!r}")
    completion = dict(config.get("completion_config") or {})
    chat = dict(config.get("chat_completion_config") or {})
    template = chat.pop("chat_template", None)
    _check_keys("completion_config", completion, CompletionRequest)
    _check_keys("chat_completion_config", chat, ChatCompletionRequest)
    return OpenaiDefaults(enabled, completion, chat, template)


def _check_keys(name: str, defaults: dict, cls) -> None:
    allowed = set(cls.model_fields) - _PER_REQUEST
    unknown = sorted(set(defaults) - allowed)
    if unknown:
        raise ConfigError(f"{name} has keys that are not request fields: {unknown}")
    example = {"model": "m", "prompt": "p", "messages": [{"role": "user", "content": "c"}]}
    try:
        cls.model_validate({**example, **defaults})  # a default obeys the same rules as a request
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"{name}.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
