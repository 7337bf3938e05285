"""Compiled decode steps (`--compile`): torch.compile over runs of layers, compiled on a thread of its
own while the worker serves eagerly; the graphs call the same C kernels as the eager steps."""

from __future__ import annotations

import os
import threading
import time
import types

import torch

from services.worker.backends.kv_pool import null_block
from services.worker.backends.torch_cpu.attention import AttentionMetadata
from services.worker.backends.torch_cpu.compile_probe import COMPILE_OPTIONS, probe
from services.worker.backends.torch_cpu.inputs import MIN_DECODE_BLOCKS
from services.worker.backends.torch_cpu.w8a8 import W8A8Linear
from services.worker.models.llama import run_layers
from shared.config import COMPILE_NICE
from shared.log import get_logger

log = get_logger("worker.compiled")
MAX_LAYERS_PER_CALL = 8
MAX_BATCH = 8
# dynamo specializes a batch of 1; every other batch up to the compiled max shares one graph
WARM_UP_BATCHES = (1, 2, MAX_BATCH)


class CompiledLayers:
    """The model's layer runner under --compile: decode-only steps of up to `max_batch` rows go
    through the compiled runs of `layers_per_call` layers; anything else runs eagerly.

    The graphs skip guards on the modules (their checks would cost more than a step saves), so a
    graph holds its run's module structure as constants: which modules, their formats (a Q4_K_M
    file's Q6_K layers among Q4_K ones), each kernel's flags. Runs of the same structure share a
    graph; each other structure compiles its own, from its own copy of run_layers' code (dynamo
    keeps graphs on the code object)."""

    def __init__(self, num_layers: int, max_batch: int):
        self.max_batch = max_batch
        self.layers_per_call = max(n for n in range(1, MAX_LAYERS_PER_CALL + 1) if num_layers % n == 0)
        self.runs: list = []  # each run's compiled function, made at its first call
        self._by_structure: dict[tuple, object] = {}

    def __call__(self, layers, x, residual, cos, sin, kv_caches, meta: AttentionMetadata):
        if meta.prefills or x.shape[0] > self.max_batch:
            return run_layers(layers, x, residual, cos, sin, kv_caches, meta)
        for run, i in enumerate(range(0, len(layers), self.layers_per_call)):
            j = i + self.layers_per_call
            if run == len(self.runs):
                self.runs.append(self._compiled_for(structure(layers[i:j])))
            x, residual = self.runs[run](list(layers[i:j]), x, residual, cos, sin, kv_caches[i:j], meta)
        return x, residual

    def _compiled_for(self, key: tuple):
        if key not in self._by_structure:
            code = run_layers.__code__.replace(co_name=f"run_layers_{len(self._by_structure)}")
            self._by_structure[key] = torch.compile(
                types.FunctionType(code, run_layers.__globals__, code.co_name), dynamic=True,
                options=COMPILE_OPTIONS | {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        return self._by_structure[key]


def structure(layers) -> tuple:
    """What a compiled run takes as constants: each module's name, class, plain attributes (bits,
    group, int8_activations ...; not those its class names `not_in_graph`) and which of its buffers
    are absent."""
    return tuple((name, type(m).__name__,
                  tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, (bool, int, float, str))
                               and k not in getattr(m, "not_in_graph", ()))),
                  tuple(sorted(k for k, b in m._buffers.items() if b is None)))
                 for index, layer in enumerate(layers) for name, m in layer.named_modules(prefix=str(index)))


def compile_decode_layers(model: torch.nn.Module, max_num_seqs: int, install: bool = True) -> CompiledLayers:
    """A compiled layer runner for `model`'s (a Llama's) decode-only steps; `install`: the model uses it now."""
    # dynamo's code cache is keyed by run_layers' code and its module guards are skipped, so a
    # model compiled earlier in this process (tests compile several) would lend this one its graphs
    torch._dynamo.reset()
    w8a8 = any(isinstance(m, W8A8Linear) for m in model.modules())
    runner = CompiledLayers(len(model.layers), max(max_num_seqs, MAX_BATCH) if w8a8 else MAX_BATCH)
    if install:
        model.layer_runner = runner
    return runner


class BackgroundCompile:
    """The probe, then the compile and its warm-up, on a thread of its own at the lowest priority and
    with one compile job; the model's decode steps take the compiled layers once every graph is
    ready. `state` says where it is, as the worker announces it."""

    def __init__(self, model: torch.nn.Module, kv_caches, block_size: int, max_num_seqs: int, probe_cache,
                 nice: int = COMPILE_NICE):
        self.state = "compiling decode steps"
        self.runner = compile_decode_layers(model, max_num_seqs, install=False)
        self.nice = nice
        self.thread = threading.Thread(target=self._work, args=(model, kv_caches, block_size, probe_cache),
                                       name="compile-decode-layers", daemon=True)
        self.thread.start()

    def _work(self, model, kv_caches, block_size: int, probe_cache) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)  # this thread, and its compilers
        if failure := probe(probe_cache):
            self.state = f"not compiled: {failure}"
            log.error("compile_probe_failed", reason=failure)
            return
        try:
            warm_up(model, kv_caches, block_size, self.runner)
        except Exception as exc:  # the worker goes on serving eagerly: the same numbers, a little slower
            self.state = f"compile failed ({type(exc).__name__}): eager decode steps"
            log.exception("compile_failed")
            return
        model.layer_runner = self.runner
        self.state = "compiled decode steps"


@torch.inference_mode()
def warm_up(model: torch.nn.Module, kv_caches, block_size: int, runner: CompiledLayers | None = None) -> float:
    """Run one decode step at each WARM_UP_BATCHES size through `runner` (the model's own by default)
    so every graph compiles now, not under load. `kv_caches` must be the pool the worker serves
    from. The step reads and writes only the null block. Returns the seconds it took."""
    started = time.perf_counter()
    runner = runner or model.layer_runner
    null = null_block(kv_caches)
    for k_cache, v_cache in kv_caches:
        torch._dynamo.mark_static(k_cache)
        torch._dynamo.mark_static(v_cache)
    for batch in sorted({*WARM_UP_BATCHES, runner.max_batch}):
        positions = torch.full((batch,), block_size, dtype=torch.long)  # a token in the table's second block
        meta = AttentionMetadata(
            slot_mapping=torch.full((batch,), null * block_size, dtype=torch.long),
            decode_token_idx=torch.arange(batch),
            decode_block_tables=torch.full((batch, MIN_DECODE_BLOCKS), null, dtype=torch.long),
            decode_context_mask=torch.ones(batch, 1, 1, MIN_DECODE_BLOCKS * block_size, dtype=torch.bool),
            decode_context_lens=torch.full((batch,), MIN_DECODE_BLOCKS * block_size, dtype=torch.long),
            prefills=[],
        )
        cos, sin = model.rotary.cos_sin(positions)  # the model's forward, with `runner` as its layer runner
        x = model.tok_embeddings(torch.zeros(batch, dtype=torch.long))
        runner(model.layers, x, torch.zeros_like(x), cos, sin, kv_caches, meta)
    seconds = time.perf_counter() - started
    log.info("compiled_decode_ready", layers_per_call=runner.layers_per_call, max_batch=runner.max_batch,
             seconds=round(seconds, 1))
    return seconds
