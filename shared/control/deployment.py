"""From a deployed pipeline and its model version to what each service runs.

The scheduler, the worker and the API derive their settings for a deployment here, from the same
records, so they cannot disagree (the scheduler still refuses a worker whose KV geometry differs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.config import DEFAULTS, ConfigError, EngineConfig
from shared.control.deploy_config import DeploymentConfig, parse_memory
from shared.control.registry import ModelVersion, Pipeline, Registry
from shared.speculative import parse_speculative_config


@dataclass
class DeployedModel:
    pipeline: Pipeline
    version: ModelVersion
    loras: list[ModelVersion] = field(default_factory=list)  # LoRA adapters served beside the model
    lora_paths: dict[str, str] = field(default_factory=dict)  # on a worker: each adapter's files, by name

    @property
    def name(self) -> str:
        return self.pipeline.deployment

    @property
    def deployment_config(self) -> DeploymentConfig:
        return self.pipeline.deployment_config or DeploymentConfig()

    @property
    def is_single_batch(self) -> bool:
        return self.version.batch_config == "single"

    def engine_config(self) -> EngineConfig:
        """The framework and continuous-batching configs as engine settings for this deployment."""
        fc, cb = self.version.framework_config, self.version.continuous_batching_config
        max_num_seqs = 1 if self.is_single_batch else fc.max_num_seqs
        block_size = fc.effective_block_size
        return EngineConfig(
            model=self.name, max_model_len=fc.max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(DEFAULTS.max_num_batched_tokens, block_size), block_size=block_size,
            kv_cache_dtype=fc.kv_cache_dtype, quantization=fc.quantization or "auto",
            kv_offloading_size=fc.kv_offloading_size,
            gpu_memory_utilization=fc.gpu_memory_utilization, max_seq_len_to_capture=fc.max_seq_len_to_capture,
            max_concurrent_batch_size=1 if self.is_single_batch else (
                cb.max_concurrent_batch_size if cb else DEFAULTS.max_concurrent_batch_size),
            speculative_config=parse_speculative_config(cb.speculative_config) if cb else None,
        ).validate()

    # ---- one worker process (the seed product's sidekick) ----------------------------------------

    @property
    def worker_threads(self) -> int:
        return max(1, math.floor(self.deployment_config.sidekick(self.version.name).cpus))

    @property
    def worker_memory(self) -> int:
        return parse_memory("memory", self.deployment_config.sidekick(self.version.name).memory)

    def kv_cache_bytes(self, weight_bytes: int) -> int:
        """vLLM's rule on the worker's memory: utilization x memory, less the weights, is the KV pool."""
        util = self.version.framework_config.gpu_memory_utilization
        budget = int(util * self.worker_memory) - weight_bytes
        if budget <= 0:
            raise ConfigError(
                f"gpu_memory_utilization {util} x sidekick memory {self.worker_memory / 2**20:.0f} MiB leaves "
                f"no room for a KV cache after {weight_bytes / 2**20:.0f} MiB of weights: raise sidekick_memory")
        return budget

    def engine_resources(self) -> tuple[float, int, int]:
        """(cpus, bytes, 0 SoCs) the engine (the deployment's scheduler queue) reserves in the scheduler process."""
        d = self.deployment_config
        return d.cpus, parse_memory("memory", d.memory), 0

    def resources_per_replica(self) -> tuple[float, int, int]:
        """(cpus, bytes, QAIC SoCs) one replica takes on a worker host. A QAIC replica takes its
        sidekick_gpus SoCs (the product's meaning of gpus for QAIC), at least its program's num_devices."""
        side = self.deployment_config.sidekick(self.version.name)
        if self.version.accel.kind != "qaic":
            return side.cpus, self.worker_memory, 0
        num_devices = self.version.accel.qaic.num_devices if self.version.accel.qaic else 1
        return side.cpus, self.worker_memory, max(side.gpus, num_devices)


async def load_deployed(registry: Registry, pipeline: Pipeline) -> DeployedModel:
    """The pipeline's one model step with its version record."""
    if len(pipeline.steps) != 1:
        raise ConfigError(f"pipeline {pipeline.name!r} has {len(pipeline.steps)} model steps; "
                          "an LLM pipeline has exactly one")
    step = pipeline.steps[0]
    version = await registry.version(step.model, step.version)
    if version is None:
        raise ConfigError(f"model {step.model!r} version {step.version} is not in the registry")
    if version.status == "converting":
        raise ConfigError(f"model {step.model!r} version {step.version} is still converting: deploy it once its "
                          "status is ready")
    if version.status != "ready":
        raise ConfigError(f"model {step.model!r} version {step.version} is {version.status}: {version.error}")
    loras = []
    for adapter in pipeline.loras:
        record = await registry.version(adapter.model, adapter.version)
        if record is None or record.status != "ready":
            raise ConfigError(f"LoRA adapter {adapter.model!r} version {adapter.version} is not ready in the registry")
        if record.lora_base != step:
            raise ConfigError(f"LoRA adapter {adapter.model!r} adapts {record.lora_base}, not this pipeline's model step")
        loras.append(record)
    return DeployedModel(pipeline, version, loras)
