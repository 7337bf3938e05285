"""Switchyard's user-facing package: the SDK and the launcher behind `make run`.

The SDK imports as the product's notebooks import theirs, with only the package name changed:
`switchyard.Client()`, `switchyard.framework`, `switchyard.engine_config`,
`switchyard.deployment_config`, `switchyard.openai_config`, `switchyard.continuous_batching_config`,
`switchyard.object`; `switchyard.config` holds them all in one place.
"""

from switchyard import (  # noqa: F401 - `switchyard.framework.Framework.CUSTOM` after `import switchyard`
    continuous_batching_config,
    deployment_config,
    engine_config,
    framework,
    object,
    openai_config,
)
from switchyard.client import Client, EntityNotFoundError, ModelVersion, Pipeline, SwitchyardError

__all__ = ["Client", "EntityNotFoundError", "ModelVersion", "Pipeline", "SwitchyardError"]
