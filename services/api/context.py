"""What every API route needs: the bus client, the served models (tokenizer, limits, defaults)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client

from services.api.media.fetch import MediaPolicy
from services.api.metrics import ApiMetrics
from services.api.openai.defaults import OpenaiDefaults
from services.api.readiness import Readiness
from shared.bus.client import BusClient
from shared.bus.media import MediaStore
from shared.control.deployment import DeployedModel
from shared.control.registry import Registry
from shared.gateway_config import GATEWAY_DEFAULTS
from shared.models.tokenizer import ModelTokenizer
from shared.wire.images import ImageSpec
from shared.wire.lora import LoraInfo
from shared.wire.messages import EmbeddingSpec

if TYPE_CHECKING:  # the features' classes import this module
    from services.api.batch.batches import BatchStore
    from services.api.batch.files import FileStore
    from services.api.limits import LimitsWatcher
    from services.api.openai.generation import FinishHook
    from services.api.pipelines.deployments import DeploymentWatcher
    from services.api.pipelines.inference_log import InferenceLog
    from services.api.responses.store import ResponseStore


@dataclass
class ServedModel:
    name: str
    tokenizer: ModelTokenizer
    created: int
    max_model_len: int = 0  # as the model's scheduler publishes it (limits.py); 0: no worker serves it yet
    devices: list[str] = field(default_factory=list)  # what its workers run on ("qaic, emulated on cpu"), as published
    architectures: list[str] = field(default_factory=list)  # what its workers loaded ("Qwen3ForCausalLM"), as published
    embedding: EmbeddingSpec | None = None  # its embeddings' size and Matryoshka sizes, as published
    images: ImageSpec | None = None  # an image-text model's image geometry, as published; None: text only
    openai: OpenaiDefaults = field(default_factory=OpenaiDefaults)  # per-model OpenAI config
    max_logprobs: int = GATEWAY_DEFAULTS.max_logprobs
    pipeline: str | None = None  # set for a deployed pipeline (served by the registry, not by flags)
    loras: list[LoraInfo] = field(default_factory=list)  # the LoRA adapters its workers serve, as published
    lora: str | None = None  # set on the view of one adapter (resolve): its name is the adapter's
    base: str | None = None  # and the model it adapts
    deployed: DeployedModel | None = None

    @property
    def engine(self) -> str:
        """The model whose scheduler serves it (an adapter's: its base model's)."""
        return self.base or self.name

    @property
    def chat_template(self) -> str | None:
        return self.openai.chat_template or self.tokenizer.chat_template


@dataclass
class ServerState:
    """The gateway's own: its guards' settings (guards.py) and its lifecycle (server.py)."""

    idle_timeout_s: float = GATEWAY_DEFAULTS.idle_timeout_s
    request_timeout_s: float = GATEWAY_DEFAULTS.request_timeout_s
    max_body_bytes: int = GATEWAY_DEFAULTS.max_body_bytes
    api_keys: tuple[str, ...] = ()
    per_request_metrics: bool = False  # vLLM's --enable-per-request-metrics
    limit_images: int = GATEWAY_DEFAULTS.limit_images_per_prompt  # --limit-mm-per-prompt's "image"
    mm_processor_kwargs: dict = field(default_factory=dict)  # --mm-processor-kwargs: every request's (media/processor.py)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # what an image URL may fetch (media/fetch.py)
    is_draining: bool = False
    num_in_flight: int = 0
    readiness: Readiness = field(default_factory=Readiness)  # /ready's last verdict (readiness.py)


@dataclass
class PipelineState:
    """Deployed pipelines (pipelines/): the registry, the names each deployment answers to, the logs."""

    registry: Registry | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # pipeline or model name -> deployment
    pending: dict[str, str] = field(default_factory=dict)  # deployment -> pipeline, while it loads
    # a deployed pipeline of several steps: its deployment -> (its name, its steps' pipelines)
    parents: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    watcher: DeploymentWatcher | None = None  # fills the context's models, and aliases and pending
    inference_log: InferenceLog | None = None  # the deployed pipelines' InferenceLog (JetStream)
    oci_registry: str | None = None  # where pipeline.publish() pushes (--oci-registry)


@dataclass
class BatchState:
    """The Files and Batch APIs (batch/): their JetStream stores, made on first use."""

    files: FileStore | None = None  # a JetStream object store
    batches: BatchStore | None = None  # a JetStream key-value bucket
    concurrency: int = GATEWAY_DEFAULTS.batch_concurrency  # lines of one batch in flight at once (batch/runner.py)


@dataclass
class ApiContext:
    nc: Client
    bus: BusClient
    models: dict[str, ServedModel]
    metrics: ApiMetrics = field(default_factory=ApiMetrics)
    server: ServerState = field(default_factory=ServerState)
    limits: LimitsWatcher | None = None  # sets each served model's max_model_len
    tool_call_parser: str = "auto"  # how the models' text becomes tool calls (openai/tools/parsers.py)
    reasoning_parser: str | None = None  # where a chat answer's thinking is (openai/reasoning.py); None: none
    responses: ResponseStore | None = None  # the Responses API's store (JetStream), made on first use
    media: MediaStore | None = None  # image inputs' pixels for the workers (shared/bus/media.py), made on first use
    batch: BatchState = field(default_factory=BatchState)
    pipelines: PipelineState = field(default_factory=PipelineState)
    # what features hook onto each OpenAI request: given its model and body, a hook each of its
    # generations calls at its end, or None (the pipelines feature registers its inference log)
    request_hooks: list[Callable[[ServedModel, Any], FinishHook | None]] = field(default_factory=list)

    def finish_hook(self, model: ServedModel, body: Any) -> FinishHook | None:
        """What each generation of this request calls at its end (None: nothing asks)."""
        hooks = [h for make in self.request_hooks if (h := make(model, body)) is not None]
        if len(hooks) <= 1:
            return hooks[0] if hooks else None

        def each(gen) -> None:
            for hook in hooks:
                hook(gen)
        return each

    def resolve(self, name: str) -> ServedModel | None:
        """A served model by its name, or by its pipeline's or model's name, or one of its LoRA
        adapters by the adapter's name (a view of the base model that names the adapter)."""
        found = self.models.get(name) or self.models.get(self.pipelines.aliases.get(name, ""))
        if found is not None:
            return found
        base = next((m for m in self.models.values() if any(info.name == name for info in m.loras)), None)
        return dataclasses.replace(base, name=name, lora=name, base=base.name) if base is not None else None

    def is_pending(self, name: str) -> bool:
        pending = self.pipelines.pending
        return name in pending or self.pipelines.aliases.get(name) in pending
