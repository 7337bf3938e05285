"""`from switchyard.framework import Framework, VLLMConfig`: the product's names for the framework
an uploaded model runs on and its configuration."""

from __future__ import annotations

import enum

from shared.control.deploy_config import FrameworkConfig

# vLLM's engine arguments as the product's VLLMConfig carries them (validated by the server)
VLLMConfig = FrameworkConfig
# the product's custom-runtime config has the same fields: they configure the engine the custom
# model's script gets (docs/deploy.md, "Custom runtimes")
CustomConfig = FrameworkConfig


class Framework(enum.StrEnum):
    VLLM = "vllm"
    CUSTOM = "custom"


__all__ = ["CustomConfig", "Framework", "VLLMConfig"]
