"""Compiled decode layers (`--compile`): torch.compile (Inductor's C++ backend) over one layer.

In a decode step the model is ~100 small ops per layer (norms, rotary, the attention's reshapes,
the SwiGLU); at batch 1 launching them costs more than computing them. Inductor fuses each layer's
elementwise work into a few generated C++ loops around the GEMMs. One compiled function serves
every layer: the weights are inputs to the graph (dynamo inlines nn.Modules), so 30 layers cost
one compilation, not thirty, and dynamo skips the guards on module state it would otherwise check
on every call (the weights never change after loading).

Only decode-only steps use it; a step with a prefill chunk runs eagerly, because the prefill path
unrolls per chunk and would compile once per number of chunks. Shapes are dynamic, but dynamo
specializes sizes 0 and 1, and the quantized Linears branch on the row count, so `warm_up`
compiles every graph a decode step can need (batch 1, small batches, large batches) before the
worker takes traffic (tests/test_compiled.py checks that nothing compiles after it; a shape that
did would stall one step for a compile, not fail it; torch's "eager_on_recompile" stance would
avoid that stall but slowed every step by half here). Block tables are padded to at least two blocks (`MIN_DECODE_BLOCKS`), so a short
context never meets a one-block graph. Inductor caches what it compiled on disk
(`TORCHINDUCTOR_CACHE_DIR`), so only a worker's first start on a machine pays the full compile.
"""

from __future__ import annotations

import time

import torch

from services.worker.attention import AttentionMetadata
from shared.log import get_logger

log = get_logger("worker.compiled")
MIN_DECODE_BLOCKS = 2
# batch sizes that hit each graph: 1 (specialized), 2 (the generic small-batch kernel path of the
# quantized Linears), 9 (above every small-batch threshold: the dense path)
WARM_UP_BATCHES = (1, 2, 9)


def compile_decode_layers(model: torch.nn.Module) -> None:
    """Give `model` (a Llama) one compiled layer function for its decode-only steps."""
    layer_forward = type(model.layers[0]).forward
    model.compiled_layer = torch.compile(
        layer_forward, dynamic=True,
        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )


@torch.inference_mode()
def warm_up(model: torch.nn.Module, kv_caches, block_size: int) -> float:
    """Run one decode step at each WARM_UP_BATCHES size so every graph compiles now, not under load.
    It writes K/V into the first blocks of the pool, which nothing owns yet. Returns the seconds."""
    started = time.perf_counter()
    num_blocks = MIN_DECODE_BLOCKS
    for batch in WARM_UP_BATCHES:
        positions = torch.full((batch,), block_size, dtype=torch.long)  # one token into the second block
        meta = AttentionMetadata(
            slot_mapping=torch.full((batch,), block_size, dtype=torch.long),
            decode_token_idx=torch.arange(batch),
            decode_block_tables=torch.arange(num_blocks).repeat(batch, 1),
            decode_context_mask=torch.ones(batch, 1, 1, num_blocks * block_size, dtype=torch.bool),
            prefills=[],
        )
        model(torch.zeros(batch, dtype=torch.long), positions, kv_caches, meta)
    seconds = time.perf_counter() - started
    log.info("compiled_decode_ready", batches=list(WARM_UP_BATCHES), seconds=round(seconds, 1))
    return seconds
