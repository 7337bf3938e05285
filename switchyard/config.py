"""The SDK's configuration objects, with the seed product's names.

FrameworkConfig, QaicConfig, ContinuousBatchingConfig and OpenaiConfig are the wire types the
server validates (`shared/control/deploy_config.py`); Acceleration and DeploymentConfigBuilder build the
rest. Every value is checked again by the server, which names the field and range it refuses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.control.deploy_config import (
    ContinuousBatchingConfig,
    DeploymentConfig,
    FrameworkConfig,
    OpenaiConfig,
    QaicConfig,
    SidekickResources,
)

__all__ = ["Acceleration", "AccelerationWithConfig", "ContinuousBatchingConfig", "DeploymentConfig",
           "DeploymentConfigBuilder", "FrameworkConfig", "OpenaiConfig", "QaicConfig"]


@dataclass(frozen=True)
class AccelerationWithConfig:
    accel: Acceleration
    config: QaicConfig

    def to_wire(self) -> dict:
        import msgspec

        return {self.accel.value: msgspec.to_builtins(self.config)}


class Acceleration(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    QAIC = "qaic"

    def with_config(self, config: QaicConfig) -> AccelerationWithConfig:
        if self is not Acceleration.QAIC:
            raise ValueError(f"{self.value} takes no accelerator config")
        return AccelerationWithConfig(self, config)

    def to_wire(self) -> str:
        return self.value


class DeploymentConfigBuilder:
    """Replicas and resources: `.replicas(1, 2).cpus(1).memory("1Gi").sidekick_cpus(llm, 2)...build()`."""

    def __init__(self):
        self._config = DeploymentConfig()
        self._sidekicks: dict[str, SidekickResources] = {}

    def replicas(self, minimum: int, maximum: int | None = None) -> DeploymentConfigBuilder:
        self._config.replicas_min = minimum
        self._config.replicas_max = minimum if maximum is None else maximum
        return self

    def replica_count(self, count: int) -> DeploymentConfigBuilder:
        return self.replicas(count, count)

    def replica_autoscale_min_max(self, maximum: int, minimum: int = 1) -> DeploymentConfigBuilder:
        return self.replicas(minimum, maximum)

    def cpus(self, cpus: float) -> DeploymentConfigBuilder:
        self._config.cpus = cpus
        return self

    def memory(self, memory: str) -> DeploymentConfigBuilder:
        self._config.memory = memory
        return self

    def _sidekick(self, model) -> SidekickResources:
        return self._sidekicks.setdefault(getattr(model, "name", model), SidekickResources())

    def sidekick_cpus(self, model, cpus: float) -> DeploymentConfigBuilder:
        self._sidekick(model).cpus = cpus
        return self

    def sidekick_memory(self, model, memory: str) -> DeploymentConfigBuilder:
        self._sidekick(model).memory = memory
        return self

    def sidekick_gpus(self, model, gpus: int) -> DeploymentConfigBuilder:
        self._sidekick(model).gpus = gpus
        return self

    def deployment_label(self, label: str) -> DeploymentConfigBuilder:
        """"key:value": only worker hosts (agents) with that label run the deployment."""
        self._config.deployment_label = label
        return self

    def deterministic(self, on: bool = True) -> DeploymentConfigBuilder:
        """Batch-invariant float32 workers: a request's tokens do not depend on its batch (slower)."""
        self._config.deterministic = on
        return self

    def build(self) -> DeploymentConfig:
        self._config.sidekicks = dict(self._sidekicks)
        return self._config
