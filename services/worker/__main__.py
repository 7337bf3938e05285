"""python -m services.worker: load the model, allocate the paged KV pool, serve Steps over NATS."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import uuid

import torch

from services.worker.compiled import compile_decode_layers, warm_up
from services.worker.dense import pack_linears
from services.worker.deployment import drain_when_orphaned, fetch_deployment, weight_bytes
from services.worker.guided import GrammarCompiler
from services.worker.kv_cache import allocate_kv_cache, check_capacity, kv_dtype_for, num_blocks_for_budget
from services.worker.loader import load_model
from services.worker.main_thread import MainThreadExecutor, run_with_bus_thread
from services.worker.model_runner import ModelRunner
from services.worker.quantization import quantize
from services.worker.service import WorkerService
from shared import log as sylog
from shared.bus import connect
from shared.config import (
    add_engine_args,
    add_nats_arg,
    add_worker_args,
    engine_config_from_args,
    resolve_max_model_len,
)
from shared.lifecycle import serve
from shared.messages import WorkerHello
from shared.model_files import resolve_model_path
from shared.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Switchyard worker (torch backend)")
    add_engine_args(parser)
    add_nats_arg(parser)
    add_worker_args(parser)
    return parser.parse_known_args()[0]  # the launcher checked them all and passes each service all


def main() -> None:
    args = parse_args()
    worker_id = args.worker_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    sylog.configure("worker")
    deployed = None
    if args.pipeline:  # started by an agent for a deployed pipeline: its configs come from the registry
        deployed, model_path = fetch_deployment(args.nats_url, args.pipeline, args.generation)
        config = deployed.engine_config()
        args.threads = deployed.worker_threads
    else:
        config = engine_config_from_args(args)
        model_path = resolve_model_path(config.model_path)
    # set even when it is torch's own default: left implicit, the decode step ran ~20% slower here
    # (bench/profile_step.py, 2026-11-22)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    if args.nice:
        os.nice(args.nice)
    dtype = DTYPES[args.dtype]
    loaded = load_model(model_path, config.load_format, dtype)
    quantize(loaded.model, config.quantization)
    if not args.compile:  # compiled layers cannot take oneDNN's packed weights (dense.py)
        pack_linears(loaded.model)
    max_model_len = resolve_max_model_len(config.max_model_len, loaded.config.max_position_embeddings)
    kv_dtype = kv_dtype_for(config.kv_cache_dtype, dtype)
    kv_bytes = (deployed.kv_cache_bytes(weight_bytes(loaded.model)) if deployed
                else int(config.kv_cache_memory_gib * 2**30))
    num_blocks = config.num_kv_blocks or num_blocks_for_budget(loaded.config, config.block_size, kv_dtype, kv_bytes)
    check_capacity(loaded.config, num_blocks, config.block_size, kv_dtype, max_model_len)
    caches = allocate_kv_cache(loaded.config, num_blocks, config.block_size, kv_dtype)
    grammar = GrammarCompiler(load_tokenizer(model_path).tokenizer.to_str(), loaded.config.vocab_size,
                              loaded.config.eos_token_ids) if config.load_format != "dummy" else None
    if args.compile:
        compile_decode_layers(loaded.model, config.max_num_seqs)
        warm_up(loaded.model, caches, config.block_size)
    runner = ModelRunner(loaded.model, caches, config.block_size, max_model_len, loaded.config.eos_token_ids,
                         grammar=grammar)
    hello = WorkerHello(worker_id=worker_id, model=config.model, backend="torch", kind="paged",
                        num_blocks=num_blocks, block_size=config.block_size, max_batch=config.max_num_seqs,
                        dtype=args.dtype, max_model_len=max_model_len, kv_cache_dtype=config.kv_cache_dtype)
    executor = MainThreadExecutor()

    async def serve_bus(signalled: asyncio.Event) -> None:
        nc = await connect(args.nats_url, f"worker-{worker_id}")
        if deployed is not None:  # an agent's replica: it must not outlive the agent that counts it
            asyncio.get_running_loop().create_task(drain_when_orphaned(signalled))
        await serve(nc, WorkerService(nc, runner, hello, executor), signalled, config.drain_grace_s)

    run_with_bus_thread(serve_bus, executor)


if __name__ == "__main__":
    main()
