"""CustomInferenceConfig: where the uploaded artifact is, handed to InferenceBuilder.create()."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class CustomInferenceConfig:
    model_path: Path  # the unpacked artifact: the script, requirements.txt and the model's files
    framework: str = "custom"
