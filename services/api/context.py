"""What every API route needs: the bus client, the served models (tokenizer, limits, defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.client import Client

from services.api.metrics import ApiMetrics
from services.api.openai_defaults import OpenaiDefaults
from shared.client import BusClient
from shared.tokenizer import ModelTokenizer


@dataclass
class ServedModel:
    name: str
    tokenizer: ModelTokenizer
    max_model_len: int
    created: int
    openai: OpenaiDefaults = field(default_factory=OpenaiDefaults)  # per-model OpenAI config
    max_logprobs: int = 20

    @property
    def chat_template(self) -> str | None:
        return self.openai.chat_template or self.tokenizer.chat_template


@dataclass
class ApiContext:
    nc: Client
    bus: BusClient
    models: dict[str, ServedModel]
    metrics: ApiMetrics = field(default_factory=ApiMetrics)
    idle_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    max_body_bytes: int = 16 * 2**20
    api_keys: tuple[str, ...] = ()
    is_draining: bool = False
    num_in_flight: int = 0
