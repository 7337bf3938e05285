"""What every API route needs: the bus client, the served model's tokenizer and limits."""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.client import Client

from services.api.tokenizer import ModelTokenizer
from shared.client import BusClient


@dataclass
class ServedModel:
    name: str
    tokenizer: ModelTokenizer
    max_model_len: int
    created: int


@dataclass
class ApiContext:
    nc: Client
    bus: BusClient
    models: dict[str, ServedModel]
    idle_timeout_s: float = 300.0
