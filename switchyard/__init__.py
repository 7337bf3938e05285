"""Switchyard's user-facing package: the SDK (`Client`, `switchyard.config`) and the launcher
behind `make run`."""

from switchyard.client import Client, ModelVersion, Pipeline, SwitchyardError

__all__ = ["Client", "ModelVersion", "Pipeline", "SwitchyardError"]
