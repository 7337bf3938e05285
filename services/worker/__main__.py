"""python -m services.worker: load the model on its backend (--device), serve Steps over NATS."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import uuid
from pathlib import Path

import torch

from services.worker.backends import create_backend
from services.worker.backends.spec import WorkerSpec
from services.worker.custom_runtime import supervise
from services.worker.deployment import drain_when_orphaned
from services.worker.draft_proposer import DraftModelProposer
from services.worker.eagle_proposer import Eagle3Proposer
from services.worker.guided import GrammarCompiler
from services.worker.kv_disk import DiskTier
from services.worker.kv_tier import HostTier
from services.worker.lora.adapter import LoraError
from services.worker.lora.manager import LoraManager
from services.worker.main_thread import MainThreadExecutor, run_with_bus_thread
from services.worker.model_runner import ModelRunner, Proposer
from services.worker.ngram import NgramProposer
from services.worker.service import WorkerService
from services.worker.settings import WorkerSettings, resolve
from services.worker.suffix import SuffixProposer
from shared import log as sylog
from shared.bus import connect
from shared.bus.lifecycle import serve
from shared.config import (
    ConfigError,
    add_engine_args,
    add_nats_arg,
    add_worker_args,
    resolve_max_model_len,
)
from shared.engine_defaults import EngineDefaults, own_quantization, pick_for_host
from shared.models.model_files import cache_root, resolve_model_path
from shared.models.tokenizer import load_tokenizer
from shared.wire.messages import WorkerHello, WorkerKind


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
    settings = resolve(args)
    config, model_path, device = settings.config, settings.model_path, settings.device
    # set even when it is torch's own default: left implicit, the decode step ran ~20% slower here
    # (bench/profile_step.py, 2026-11-22)
    torch.set_num_threads(settings.threads or torch.get_num_threads())
    if settings.nice:
        os.nice(settings.nice)
    defaults = engine_defaults(settings) if device == "cpu" else None
    if defaults is not None:
        sylog.get_logger("worker").info("engine_defaults", **defaults.as_log())
    spec = worker_spec(settings, defaults)
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
    if backend.draft is None:
        backend.kv.check_capacity(backend.num_blocks, max_model_len)
    else:  # each block holds the draft's KV too
        backend.kv.check_capacity(backend.num_blocks, max_model_len, extra_per_block=backend.draft.kv.bytes_per_block)
    generates = config.load_format != "dummy" and backend.config.pooling is None  # an encoder samples nothing
    grammar = GrammarCompiler(load_tokenizer(model_path).tokenizer.to_str(), backend.config.vocab_size,
                              backend.config.eos_token_ids) if generates else None
    lora = lora_manager(backend, settings)
    backend.warm_up()
    # sleep mode's wake builds the backend again from the file (a background compile would hold the old one)
    rebuild = None if spec.compile else lambda: create_backend(device, spec)
    proposer = spec_proposer(backend, settings)
    # shared by the model's workers on this host that one scheduler (on this bus) indexes
    tier = HostTier.open(f"{args.nats_url} {config.model}", backend.kv_tensors(), config.kv_offloading_size,
                         Path(config.kv_offloading_dir) if config.kv_offloading_dir else None) \
        if config.kv_offloading_size else None
    if tier is not None and config.kv_offloading_disk_size:
        tier.disk = DiskTier.open(tier, config.kv_offloading_disk_size,
                                  Path(config.kv_offloading_disk_dir) if config.kv_offloading_disk_dir else None)
    runner = ModelRunner(backend, max_model_len, backend.config.eos_token_ids, grammar=grammar, rebuild=rebuild,
                         lora=lora, proposer=proposer, tier=tier)
    info = backend.describe()
    hello = WorkerHello(worker_id=worker_id, model=config.model, max_batch=config.max_num_seqs,
                        max_model_len=max_model_len, vocab_size=backend.config.vocab_size,
                        architecture=backend.config.architecture, embedding=backend.config.embedding_spec(),
                        images=backend.images.spec if backend.images is not None else None,
                        num_scheduler_steps=defaults.num_scheduler_steps.value if defaults else 1,
                        max_loras=lora.limits.max_loras if lora else 0, loras=lora.infos if lora else [],
                        backend=info.backend, kind=info.kind, num_blocks=info.num_blocks, block_size=info.block_size,
                        dtype=info.dtype, device=info.device, prefill_seq_len=info.prefill_seq_len,
                        kv_cache_dtype=info.kv_cache_dtype or config.kv_cache_dtype,
                        num_speculative_tokens=proposer.num_speculative_tokens if proposer else 0,
                        spec_max_batch=config.speculative_config.max_batch if proposer else 0,
                        kv_tier=tier.info() if tier else None,
                        kv_role=config.kv_transfer_config.kv_role if config.kv_transfer_config else "kv_both",
                        instance=uuid.uuid4().hex)
    del backend  # the runner holds it alone, so that sleep mode frees it
    executor = MainThreadExecutor()

    async def serve_bus(signalled: asyncio.Event) -> None:
        nc = await connect(args.nats_url, f"worker-{worker_id}")
        if settings.is_deployment:  # an agent's replica: it must not outlive the agent that counts it
            asyncio.get_running_loop().create_task(drain_when_orphaned(signalled))
        runtime, custom = None, settings.custom
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

    try:
        run_with_bus_thread(serve_bus, executor)
    finally:
        if tier is not None:
            tier.close()


async def _set_when(first: asyncio.Event, then: asyncio.Event) -> None:
    await first.wait()
    then.set()


def lora_manager(backend, settings: WorkerSettings) -> LoraManager | None:
    """LoRA slots on the model's Linears and the adapters in them (--enable-lora and --lora-modules,
    or a deployed pipeline's adapters); None: off."""
    modules, limits = settings.lora_modules, settings.lora_limits
    if modules is None:
        return None
    if settings.device == "qaic":
        raise ConfigError("LoRA adapters: the qaic backend runs one compiled program of the base model's weights "
                          "(docs/qaic.md); serve adapters on the cpu or cuda backend")
    if backend.encoder is not None:
        raise ConfigError(f"LoRA adapters: {backend.config.architecture} is an encoder; adapters are served for "
                          "decoders")
    manager = LoraManager(backend.model, backend.config, limits)
    try:
        for name, path in modules.items():
            manager.add(name, path)
    except LoraError as exc:
        raise ConfigError(str(exc)) from None
    return manager


def spec_proposer(backend, settings: WorkerSettings) -> Proposer | None:
    """Speculative decoding's drafts (--speculative-config); None: off."""
    spec = settings.config.speculative_config
    if spec is None:
        return None
    if backend.kind == WorkerKind.SLOTS:
        raise ConfigError("speculative decoding: the qaic backend runs programs compiled for one token per decode "
                          "slot (docs/qaic.md); speculate on the cpu or cuda backend")
    if backend.encoder is not None or backend.config.pooling is not None:
        raise ConfigError(f"speculative decoding: {backend.config.architecture} generates no tokens")
    if spec.method in ("draft_model", "eagle3"):
        if backend.draft is None:  # the backends that cannot hold one refuse the config at their start
            raise ConfigError(f"speculative decoding: the {backend.name.value} backend holds no drafter for the "
                              f"{spec.method} method (docs/speculative_decoding.md)")
        return Eagle3Proposer(spec) if spec.method == "eagle3" else DraftModelProposer(spec)
    return SuffixProposer(spec) if spec.method == "suffix" else NgramProposer(spec)


def engine_defaults(settings: WorkerSettings) -> EngineDefaults:
    """The CPU backend's settings left on auto, for this CPU and model file (shared/engine_defaults.py)."""
    from services.worker.backends.torch_cpu.kernels.load import load as load_kernels

    kernels = load_kernels()
    return pick_for_host(settings.config, settings.model_path, dtype=settings.dtype, compile=settings.compile,
                         deterministic=settings.deterministic, kernels=None if kernels.loaded else kernels.reason)


def worker_spec(settings: WorkerSettings, defaults: EngineDefaults | None = None) -> WorkerSpec:
    """The backend's settings; `defaults` (the CPU backend) settles those left on auto."""
    config = settings.config
    quantization = config.quantization
    if quantization == "auto":  # other backends: on cuda the file's own integers (a checkpoint's, a GGUF's
        # blocks), else none (dequantized)
        own = own_quantization(settings.model_path, config.load_format) if settings.device == "cuda" else None
        quantization = own or "none"
    return WorkerSpec(
        model_path=settings.model_path, load_format=config.load_format,
        dtype=defaults.dtype.value if defaults else settings.dtype,
        quantization=defaults.quantization.value if defaults else quantization,
        kv_cache_dtype=config.kv_cache_dtype, block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks, max_num_seqs=config.max_num_seqs,
        compile=defaults.compile.value if defaults else bool(settings.compile), compile_nice=settings.compile_nice,
        quant_activations=settings.quant_activations,
        deterministic=defaults.deterministic.value if defaults else False,
        max_num_batched_tokens=config.max_num_batched_tokens, kv_cache_bytes=settings.kv_cache_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization, max_seq_len_to_capture=config.max_seq_len_to_capture,
        qaic=settings.qaic, draft_model_path=draft_model_path(config),
        draft_method=config.speculative_config.method if config.speculative_config else "draft_model",
    )


def draft_model_path(config) -> str | None:
    """The draft model's or EAGLE-3 head's checkpoint as a local path (a Hub id fetched as --model-path's is)."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("draft_model", "eagle3"):
        return None
    return resolve_model_path(spec.model, None, config.download_dir)


if __name__ == "__main__":
    main()
