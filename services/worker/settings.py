"""What a worker runs by, resolved once at start: from its flags, or from a deployed pipeline's
configs (an agent's replica), each value taken from one of the two in one place, then checked."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass

from services.worker.deployment import CustomRuntime, fetch_deployment
from services.worker.lora.manager import LoraLimits
from shared.checks import in_range
from shared.config import ConfigError, EngineConfig, engine_config_from_args
from shared.control.deploy_config import QaicConfig, convert
from shared.control.deployment import DeployedModel
from shared.models.model_files import resolve_model_path
from shared.wire.lora import parse_lora_modules


@dataclass(frozen=True)
class WorkerSettings:
    config: EngineConfig
    model_path: str  # the local file or folder to load
    device: str  # cpu, cuda or qaic (a deployment's accelerator picks it)
    dtype: str  # --dtype ("auto": the CPU backend picks, engine_defaults.py)
    threads: int  # torch's compute threads (0: torch's own count)
    nice: int
    deterministic: bool  # asked for: the flag, or a deployment's own (engine_defaults settles the CPU's)
    compile: bool | None  # --compile (None: the CPU backend picks)
    compile_nice: int  # --compile-nice: the background compile's niceness
    quant_activations: str  # --quant-activations: float32, or int8 (the CPU's 4- to 6-bit weights)
    qaic: QaicConfig
    kv_cache_bytes: Callable[[int], int]  # the KV pool's budget, given the weights' bytes
    lora_modules: dict[str, str] | None  # adapter name -> path (None: LoRA off)
    lora_limits: LoraLimits
    deployed: DeployedModel | None = None  # an agent's replica: its pipeline's records
    custom: CustomRuntime | None = None  # a custom model's runtime, beside the engine

    @property
    def is_deployment(self) -> bool:
        return self.deployed is not None


def resolve(args: argparse.Namespace) -> WorkerSettings:
    """The worker's settings from its flags, or, with --pipeline, from the deployment's records."""
    settings = _from_deployment(args) if args.pipeline else _from_flags(args)
    if settings.device != "qaic" and json.loads(args.qaic_config):
        raise ConfigError(f"--qaic-config configures the qaic backend; this worker's device is {settings.device!r}")
    settings.qaic.validate()
    if settings.device == "qaic" and settings.config.kv_offloading_size:
        raise ConfigError("--kv-offloading-size keeps paged KV blocks in host memory; the qaic backend's KV is "
                          "whole sequences in static-shape slots")
    in_range("--compile-nice", settings.compile_nice, 0, 19)
    if settings.quant_activations != "float32" and (settings.device != "cpu" or settings.deterministic):
        raise ConfigError(f"--quant-activations {settings.quant_activations} is the cpu backend's C kernels' "
                          + ("(--deterministic runs torch's float32 ops alone)" if settings.deterministic
                             else f"; the {settings.device} backend computes its own way"))
    limits = settings.lora_limits
    if settings.lora_modules is not None and (limits.max_loras < 1 or limits.max_lora_rank < 1):
        raise ConfigError("--max-loras and --max-lora-rank must be at least 1")
    if settings.lora_modules is not None and limits.max_cpu_loras is not None \
            and limits.max_cpu_loras < limits.max_loras:
        raise ConfigError(f"--max-cpu-loras {limits.max_cpu_loras} must be at least --max-loras {limits.max_loras} "
                          "(an adapter in a slot is held in host memory too)")
    return settings


def _from_flags(args: argparse.Namespace) -> WorkerSettings:
    config = engine_config_from_args(args)
    fixed_kv_bytes = int(config.kv_cache_memory_gib * 2**30)
    lora = None
    if args.enable_lora or args.lora_modules:
        try:
            lora = parse_lora_modules(args.lora_modules)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    _refuse_deterministic_on(args.device, args.deterministic)
    if args.device != "cpu" and args.compile:
        raise ConfigError(f"--compile compiles the cpu backend's decode steps; the {args.device} backend "
                          + ("captures CUDA graphs of its own" if args.device == "cuda" else "runs its compiled program"))
    return WorkerSettings(
        config=config, model_path=resolve_model_path(config.model_path, config.revision, config.download_dir),
        device=args.device, dtype=args.dtype, threads=args.threads, nice=args.nice, deterministic=args.deterministic,
        compile=args.compile, compile_nice=args.compile_nice, quant_activations=args.quant_activations,
        qaic=convert(json.loads(args.qaic_config), QaicConfig, "--qaic-config") or QaicConfig(),
        kv_cache_bytes=lambda _weights: fixed_kv_bytes, lora_modules=lora, lora_limits=_lora_limits(args))


def _from_deployment(args: argparse.Namespace) -> WorkerSettings:
    """A deployment's own `deterministic` wins over the stack's flag (which holds only where the
    deployment leaves quantization to the engine); its accelerator picks the device."""
    deployed, model_path, custom = fetch_deployment(args.nats_url, args.pipeline, args.generation)
    config = deployed.engine_config()
    own = deployed.deployment_config.deterministic
    device = deployed.version.accel.kind
    _refuse_deterministic_on(device, own)
    return WorkerSettings(
        config=config, model_path=model_path, device=device, dtype=args.dtype, threads=deployed.worker_threads,
        nice=args.nice, deterministic=own if own is not None else args.deterministic and config.quantization in (
            "auto", "none"), compile=args.compile, compile_nice=args.compile_nice,
        quant_activations=args.quant_activations, qaic=deployed.version.accel.qaic or QaicConfig(),
        kv_cache_bytes=deployed.kv_cache_bytes, lora_modules=deployed.lora_paths or None,
        lora_limits=_lora_limits(args), deployed=deployed,
        custom=custom)


def _lora_limits(args: argparse.Namespace) -> LoraLimits:
    return LoraLimits(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def _refuse_deterministic_on(device: str, asked: bool | None) -> None:
    if device == "cuda" and asked:  # qaic: its program runs the same fixed shapes whatever the batch
        raise ConfigError("--deterministic (batch-invariant float32) runs on the cpu backend; "
                          "the cuda backend computes in bfloat16 and is not batch-invariant")
