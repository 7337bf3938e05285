"""CustomInferenceConfig: where the uploaded artifact is, handed to InferenceBuilder.create()."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CustomInferenceConfig:
    model_path: Path  # the unpacked artifact: the script, requirements.txt and the model's files
    framework: str = "custom"
    model_version: str = ""
    modules_to_include: set[str] = field(default_factory=lambda: {"*.py"})
