"""Switchyard's user-facing package: the SDK and the launcher behind `make run`.

The SDK imports as the product's notebooks import theirs, with only the package name changed:
`switchyard.Client()`, `switchyard.framework`, `switchyard.engine_config`,
`switchyard.deployment_config`, `switchyard.openai_config`, `switchyard.continuous_batching_config`,
`switchyard.object`; `switchyard.config` holds them all in one place.
"""

from switchyard.client import Client, EntityNotFoundError, ModelVersion, Pipeline, SwitchyardError

__all__ = ["Client", "EntityNotFoundError", "ModelVersion", "Pipeline", "SwitchyardError"]
