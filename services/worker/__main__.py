"""python -m services.worker: load the model on its backend (--device), serve Steps over NATS."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import uuid

import torch

from services.worker.backends import create_backend
from services.worker.backends.spec import WorkerSpec
from services.worker.custom_runtime import supervise
from services.worker.deployment import drain_when_orphaned, fetch_deployment
from services.worker.guided import GrammarCompiler
from services.worker.lora.adapter import LoraError
from services.worker.lora.manager import LoraLimits, LoraManager
from services.worker.main_thread import MainThreadExecutor, run_with_bus_thread
from services.worker.model_runner import ModelRunner
from services.worker.service import WorkerService
from shared import log as sylog
from shared.bus import connect
from shared.config import (
    ConfigError,
    add_engine_args,
    add_nats_arg,
    add_worker_args,
    engine_config_from_args,
    resolve_max_model_len,
)
from shared.deploy_config import QaicConfig, convert
from shared.engine_defaults import EngineDefaults, pick_for_host
from shared.lifecycle import serve
from shared.lora import parse_lora_modules
from shared.messages import WorkerHello, WorkerKind
from shared.model_files import cache_root, resolve_model_path
from shared.tokenizer import load_tokenizer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Switchyard worker")
    add_engine_args(parser)
    add_nats_arg(parser)
    add_worker_args(parser)
    return parser.parse_known_args()[0]  # the launcher checked them all and passes each service all


def main() -> None:
    args = parse_args()
    worker_id = args.worker_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    sylog.configure("worker")
    # compiled decode layers are cached beside the model cache, not in /tmp, so they outlive a reboot
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    deployed, custom = None, None
    if args.pipeline:  # started by an agent for a deployed pipeline: its configs come from the registry
        deployed, model_path, custom = fetch_deployment(args.nats_url, args.pipeline, args.generation)
        config = deployed.engine_config()
        args.threads = deployed.worker_threads
    else:
        config = engine_config_from_args(args)
        model_path = resolve_model_path(config.model_path, config.revision, config.download_dir)
    # set even when it is torch's own default: left implicit, the decode step ran ~20% slower here
    # (bench/profile_step.py, 2026-11-22)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    if args.nice:
        os.nice(args.nice)
    device = deployed.version.accel.kind if deployed else args.device  # a deployment's accel picks it
    if device != "qaic" and json.loads(args.qaic_config):
        raise ConfigError(f"--qaic-config configures the qaic backend; this worker's device is {device!r}")
    asked_deterministic = deployed.deployment_config.deterministic if deployed else args.deterministic
    if device == "cuda" and asked_deterministic:  # qaic: its program runs the same fixed shapes whatever the batch
        raise ConfigError("--deterministic (batch-invariant float32) runs on the cpu backend; "
                          "the cuda backend computes in bfloat16 and is not batch-invariant")
    if device != "cpu" and args.compile and deployed is None:  # a deployment's worker: the stack's flag is the CPU's
        raise ConfigError(f"--compile compiles the cpu backend's decode steps; the {device} backend "
                          + ("captures CUDA graphs of its own" if device == "cuda" else "runs its compiled program"))
    defaults = engine_defaults(args, config, model_path, deployed) if device == "cpu" else None
    if defaults is not None:
        sylog.get_logger("worker").info("engine_defaults", **defaults.as_log())
    spec = worker_spec(args, config, model_path, deployed, defaults)
    if device == "qaic":  # the program's cores are the emulator's compute threads, as many as the host has
        from services.worker.backends.qaic.backend import compute_threads

        torch.set_num_threads(compute_threads(spec.qaic, os.cpu_count() or 1))
        sylog.get_logger("worker").info("qaic_cores", num_cores=spec.qaic.num_cores, num_devices=spec.qaic.num_devices,
                                        threads_per_device=torch.get_num_threads())
    backend = create_backend(device, spec)
    max_model_len = backend.config.limit_context(
        resolve_max_model_len(config.max_model_len, backend.config.max_position_embeddings),
        configured=config.max_model_len is not None)
    if backend.kind == WorkerKind.SLOTS and config.max_model_len is None:
        max_model_len = min(max_model_len, backend.block_size)  # a slot holds ctx_len tokens
    backend.kv.check_capacity(backend.num_blocks, max_model_len)
    generates = config.load_format != "dummy" and backend.config.pooling is None  # an encoder samples nothing
    grammar = GrammarCompiler(load_tokenizer(model_path).tokenizer.to_str(), backend.config.vocab_size,
                              backend.config.eos_token_ids) if generates else None
    lora = lora_manager(args, backend, device, deployed)
    backend.warm_up()
    # sleep mode's wake builds the backend again from the file (a background compile would hold the old one)
    rebuild = None if spec.compile else lambda: create_backend(device, spec)
    runner = ModelRunner(backend, max_model_len, backend.config.eos_token_ids, grammar=grammar, rebuild=rebuild,
                         lora=lora)
    info = backend.describe()
    hello = WorkerHello(worker_id=worker_id, model=config.model, max_batch=config.max_num_seqs,
                        max_model_len=max_model_len, vocab_size=backend.config.vocab_size,
                        architecture=backend.config.architecture, embedding=backend.config.embedding_spec(),
                        num_scheduler_steps=defaults.num_scheduler_steps.value if defaults else 1,
                        max_loras=lora.limits.max_loras if lora else 0, loras=lora.infos if lora else [],
                        backend=info.backend, kind=info.kind, num_blocks=info.num_blocks, block_size=info.block_size,
                        dtype=info.dtype, device=info.device, prefill_seq_len=info.prefill_seq_len,
                        kv_cache_dtype=info.kv_cache_dtype or config.kv_cache_dtype)
    del backend  # the runner holds it alone, so that sleep mode frees it
    executor = MainThreadExecutor()

    async def serve_bus(signalled: asyncio.Event) -> None:
        nc = await connect(args.nats_url, f"worker-{worker_id}")
        if deployed is not None:  # an agent's replica: it must not outlive the agent that counts it
            asyncio.get_running_loop().create_task(drain_when_orphaned(signalled))
        runtime = None
        if custom is not None:  # the user's code, in a process and environment of its own; ready first
            ready, stopping = asyncio.Event(), asyncio.Event()
            runtime = asyncio.get_running_loop().create_task(supervise(custom.python, [
                "--nats-url", args.nats_url, "--deployment", config.model, "--artifact-dir", custom.artifact_dir,
                "--model-path", model_path], stopping, ready))
            asyncio.get_running_loop().create_task(_set_when(signalled, stopping))  # its predicts end in the drain
            await asyncio.wait([runtime, asyncio.ensure_future(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
            if runtime.done():
                runtime.result()  # it could not start: the worker fails, saying why
        await serve(nc, WorkerService(nc, runner, hello, executor), signalled, config.drain_grace_s)
        if runtime is not None:
            await runtime

    run_with_bus_thread(serve_bus, executor)


async def _set_when(first: asyncio.Event, then: asyncio.Event) -> None:
    await first.wait()
    then.set()


def lora_manager(args: argparse.Namespace, backend, device: str, deployed=None) -> LoraManager | None:
    """LoRA slots on the model's Linears and the --lora-modules in them (--enable-lora), or a deployed
    pipeline's adapters; None: off."""
    if deployed is not None:  # a deployment serves its pipeline's adapters, not the stack's flags
        modules = deployed.lora_paths
        if not modules:
            return None
    else:
        if not (args.enable_lora or args.lora_modules):
            return None
        try:
            modules = parse_lora_modules(args.lora_modules)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if device == "qaic":
        raise ConfigError("LoRA adapters: the qaic backend runs one compiled program of the base model's weights "
                          "(docs/qaic.md); serve adapters on the cpu or cuda backend")
    if backend.encoder is not None:
        raise ConfigError(f"LoRA adapters: {backend.config.architecture} is an encoder; adapters are served for "
                          "decoders")
    limits = LoraLimits(args.max_loras, args.max_lora_rank, args.max_cpu_loras)
    if limits.max_loras < 1 or limits.max_lora_rank < 1:
        raise ConfigError("--max-loras and --max-lora-rank must be at least 1")
    if limits.max_cpu_loras is not None and limits.max_cpu_loras < limits.max_loras:
        raise ConfigError(f"--max-cpu-loras {limits.max_cpu_loras} must be at least --max-loras {limits.max_loras} "
                          "(an adapter in a slot is held in host memory too)")
    manager = LoraManager(backend.model, backend.config, limits)
    try:
        for name, path in modules.items():
            manager.add(name, path)
    except LoraError as exc:
        raise ConfigError(str(exc)) from None
    return manager


def engine_defaults(args: argparse.Namespace, config, model_path: str, deployed) -> EngineDefaults:
    """The CPU backend's settings left on auto, for this CPU and model file (shared/engine_defaults.py).
    A deployment's own `deterministic` wins over the stack's flag; so does its own quantization."""
    from services.worker.backends.torch_cpu.kernels.load import load as load_kernels

    deterministic = args.deterministic
    if deployed is not None:
        own = deployed.deployment_config.deterministic
        deterministic = own if own is not None else deterministic and config.quantization in ("auto", "none")
    kernels = load_kernels()
    return pick_for_host(args, config, model_path, deterministic, None if kernels.loaded else kernels.reason)


def worker_spec(args: argparse.Namespace, config, model_path: str, deployed,
                defaults: EngineDefaults | None = None) -> WorkerSpec:
    """The backend's settings: from the flags, or from a deployment's framework config; `defaults`
    (the CPU backend) settles those left on auto."""
    fixed_kv_bytes = int(config.kv_cache_memory_gib * 2**30)
    quantization = "none" if config.quantization == "auto" else config.quantization  # other backends: none
    return WorkerSpec(
        model_path=model_path, load_format=config.load_format,
        dtype=defaults.dtype.value if defaults else args.dtype,
        quantization=defaults.quantization.value if defaults else quantization,
        kv_cache_dtype=config.kv_cache_dtype, block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks, max_num_seqs=config.max_num_seqs,
        compile=defaults.compile.value if defaults else bool(args.compile),
        deterministic=defaults.deterministic.value if defaults else False,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_bytes=deployed.kv_cache_bytes if deployed else (lambda _weights: fixed_kv_bytes),
        gpu_memory_utilization=config.gpu_memory_utilization, max_seq_len_to_capture=config.max_seq_len_to_capture,
        qaic=((deployed.version.accel.qaic if deployed else
               convert(json.loads(args.qaic_config), QaicConfig, "--qaic-config")) or QaicConfig()).validate(),
    )


if __name__ == "__main__":
    main()
