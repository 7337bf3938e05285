"""Compiled decode layers (`--compile`): torch.compile (Inductor's C++ backend) over runs of layers.

In a decode step the model is ~100 small ops per layer (norms, rotary, the attention's reshapes,
the SwiGLU); at batch 1 launching them costs more than computing them. Inductor fuses each layer's
elementwise work into a few generated C++ loops around the GEMMs.

What is compiled is `run_layers` over a run of `layers_per_call` layers; the model calls it once
per run. The weights are inputs to the graph (dynamo inlines nn.Modules) and dynamo skips the
guards on module state (the weights never change after loading), so every run shares one graph.
Longer runs mean fewer calls into compiled code (each costs ~60 us of guards and wrappers here)
but a longer compile: the run is the largest divisor of the layer count up to MAX_LAYERS_PER_CALL
(30 layers: 5 calls of 6; one layer per call took ~1.2 ms more per batch-1 step).

The graph's wrapper is C++ too (`cpp_wrapper`); called from Python, its ~25 kernels per layer cost
~1 ms more per batch-1 step. Decode attention is written as loops in compiled code (attention.py).

Only decode-only steps of up to MAX_BATCH rows use it. Above that the step is arithmetic, not op
launches, and the compiled graph measured slower than eager at batch 64 (bench/profile_step.py):
compiled, float32 Linears leave oneDNN's packed weights (dense.py). A w8a8 model's GEMM is the same
op compiled or not, so its decode steps compile at every batch up to max_num_seqs (AVX2 VM,
2026-11-23: batch 16 in 73 against ~105 ms eager, 64 in 225 against ~290).
A step with a prefill chunk runs eagerly, because the prefill path unrolls per chunk and would
compile once per number of chunks.

The KV pool's shape is fixed for a worker's life and marked static. The rest is dynamic, but
dynamo specializes sizes 0 and 1 and the quantized Linears branch on the row count, so `warm_up`
compiles every graph a decode step can need (batch 1, small batches, int4's dense path) before the
compiled layers take traffic; tests/test_compiled.py checks that nothing compiles after it. (A shape that did would stall one step for the compile, not
fail it. torch's "eager_on_recompile" stance would avoid the stall, but slowed every step by half
here.) Block tables are padded to at least two blocks (`MIN_DECODE_BLOCKS`), so a short context
never meets a one-block graph. Inductor caches what it compiled on disk (`TORCHINDUCTOR_CACHE_DIR`; the
worker sets it to ~/.cache/switchyard/inductor), so only a worker's first start on a machine pays the
full compile.

A worker compiles in the background (`compile_in_background`): it serves eagerly from the start,
and its decode steps switch to the compiled layers once the warm-up has compiled every graph.
The ops choose their traced branches with `torch.compiler.is_dynamo_compiling()`, which only code
Dynamo traces reads as True. `torch.compiler.is_compiling()` is one flag for the whole process, set
while any thread compiles: read by the serving thread's eager steps, it sent them down the traced
branches during the background compile (tests/test_compiled.py holds a compile open to check).
"""

from __future__ import annotations

import threading
import time

import torch

from services.worker.backends.kv_pool import null_block
from services.worker.backends.torch_cpu.attention import AttentionMetadata
from services.worker.backends.torch_cpu.inputs import MIN_DECODE_BLOCKS
from services.worker.backends.torch_cpu.w8a8 import W8A8Linear
from services.worker.models.llama import run_layers
from shared.log import get_logger

log = get_logger("worker.compiled")
MAX_LAYERS_PER_CALL = 8
MAX_BATCH = 8
# batch sizes that reach each graph: 1 (specialized), 3 (the small-batch kernel path of the
# quantized Linears) and MAX_BATCH (a bfloat16 model's dense path starts at 5); warm_up adds the
# largest compiled batch (w8a8's). None equals the warm-up's block-table width, so dynamo does not
# tie the two sizes together.
WARM_UP_BATCHES = (1, 3, MAX_BATCH)


class CompiledLayers:
    """The model's layer runner under --compile: decode-only steps of up to `max_batch` rows go
    through the compiled runs of `layers_per_call` layers; anything else runs eagerly."""

    def __init__(self, num_layers: int, max_batch: int):
        self.max_batch = max_batch
        self.layers_per_call = max(n for n in range(1, MAX_LAYERS_PER_CALL + 1) if num_layers % n == 0)
        self.compiled = torch.compile(
            run_layers, dynamic=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "cpp_wrapper": True},
        )

    def __call__(self, layers, x, residual, cos, sin, kv_caches, meta: AttentionMetadata):
        if meta.prefills or x.shape[0] > self.max_batch:
            return run_layers(layers, x, residual, cos, sin, kv_caches, meta)
        for i in range(0, len(layers), self.layers_per_call):
            j = i + self.layers_per_call
            x, residual = self.compiled(list(layers[i:j]), x, residual, cos, sin, kv_caches[i:j], meta)
        return x, residual


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


def compile_in_background(model: torch.nn.Module, kv_caches, block_size: int, max_num_seqs: int) -> threading.Thread:
    """Compile and warm up on a thread of its own; the model's decode steps take the compiled layers
    when every graph is ready. Until then they run eagerly."""
    runner = compile_decode_layers(model, max_num_seqs, install=False)

    def work() -> None:
        try:
            warm_up(model, kv_caches, block_size, runner)
        except Exception:  # the worker goes on serving eagerly: slower, never wrong
            log.exception("compile_failed")
            return
        model.layer_runner = runner

    thread = threading.Thread(target=work, name="compile-decode-layers", daemon=True)
    thread.start()
    return thread


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
