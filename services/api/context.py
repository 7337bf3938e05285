"""What every API route needs: the bus client, the served models (tokenizer, limits, defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.client import Client

from services.api.metrics import ApiMetrics
from services.api.openai.defaults import OpenaiDefaults
from shared.client import BusClient
from shared.deployment import DeployedModel
from shared.registry import Registry
from shared.tokenizer import ModelTokenizer


@dataclass
class ServedModel:
    name: str
    tokenizer: ModelTokenizer
    created: int
    max_model_len: int = 0  # as the model's scheduler publishes it (limits.py); 0: no worker serves it yet
    devices: list[str] = field(default_factory=list)  # what its workers run on ("qaic, emulated on cpu"), as published
    openai: OpenaiDefaults = field(default_factory=OpenaiDefaults)  # per-model OpenAI config
    max_logprobs: int = 20
    pipeline: str | None = None  # set for a deployed pipeline (served by the registry, not by flags)
    deployed: DeployedModel | None = None

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
    registry: Registry | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # pipeline or model name -> deployment
    pending: dict[str, str] = field(default_factory=dict)  # deployment -> pipeline, while it loads
    deployments: object = None  # the DeploymentWatcher that fills models, aliases and pending
    limits: object = None  # the LimitsWatcher that sets each served model's max_model_len
    tool_call_parser: str = "hermes"  # how the models' text becomes tool calls (openai/tools/parsers.py)
    responses: object = None  # the ResponseStore (JetStream) of the Responses API, made on first use
    files: object = None  # the FileStore (JetStream object store) of the Files API, made on first use
    batches: object = None  # the BatchStore (JetStream key-value) of the Batch API, made on first use
    batch_concurrency: int = 16  # lines of one batch in flight at once (batch/runner.py)
    inference_log: object = None  # the deployed pipelines' InferenceLog (JetStream)
    oci_registry: str | None = None  # where pipeline.publish() pushes (--oci-registry)

    def resolve(self, name: str) -> ServedModel | None:
        """A served model by its name, or by its pipeline's or model's name."""
        return self.models.get(name) or self.models.get(self.aliases.get(name, ""))

    def is_pending(self, name: str) -> bool:
        return name in self.pending or self.aliases.get(name) in self.pending
