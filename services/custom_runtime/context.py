"""What a custom runtime process serves, for the vLLM engine API its script calls (sdk/vllm)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus.client import BusClient
from shared.models.tokenizer import ModelTokenizer


@dataclass
class RuntimeContext:
    bus: BusClient
    model: str  # the deployment's name: the engine's subjects
    model_path: str  # the model inside the artifact, as the worker loads it
    artifact_dir: str  # the unpacked artifact: the script, requirements.txt, the model
    tokenizer: ModelTokenizer


CURRENT: RuntimeContext | None = None
