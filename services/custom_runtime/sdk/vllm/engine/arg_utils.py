"""vLLM's AsyncEngineArgs: only `model`, the deployment's model; the engine's other settings are
the deployment's framework_config, so any other argument is refused by name rather than ignored."""

from __future__ import annotations


class AsyncEngineArgs:
    def __init__(self, model: str, **others):
        if others:
            raise TypeError(f"AsyncEngineArgs: {', '.join(sorted(others))}: set these in the model's framework_config "
                            "(CustomConfig) at upload; the engine here is the deployment's")
        self.model = model
