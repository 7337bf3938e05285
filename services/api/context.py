"""What every API route needs: the bus client, the served models (tokenizer, limits, defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.client import Client

from services.api.metrics import ApiMetrics
from shared.client import BusClient
from shared.tokenizer import ModelTokenizer


@dataclass
class ServedModel:
    name: str
    tokenizer: ModelTokenizer
    max_model_len: int
    created: int
    completion_defaults: dict = field(default_factory=dict)  # OpenAI config: fields a request leaves out
    chat_defaults: dict = field(default_factory=dict)
    chat_template_override: str | None = None
    max_logprobs: int = 20

    @property
    def chat_template(self) -> str | None:
        return self.chat_template_override or self.tokenizer.chat_template


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
