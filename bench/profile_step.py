"""`python -m bench.profile_step`: time (and optionally profile) the worker's decode step in process.

    python -m bench.profile_step --batch 1,16,64 --context 128 --dtype float32,bfloat16 [--compile] [--profile]
    [--torch-ops] [--small-pages] [--model-path DIR] [--quantization auto --quant-activations int8]

Builds the real ModelRunner on the default model (or --model-path's) with a paged KV cache, prefills `batch`
sequences of `context` tokens, then times decode steps: ms/step and tokens/s per setting.
"""

from __future__ import annotations

import argparse
import time

import torch

from services.worker.backends.kv_pool import KVSpec
from services.worker.backends.torch_cpu.backend import TorchCpuBackend, load_weights
from services.worker.backends.torch_cpu.compiled import compile_decode_layers, warm_up
from services.worker.backends.torch_cpu.dense import pack_linears
from services.worker.backends.torch_cpu.huge_pages import move_to_huge_pages
from services.worker.backends.torch_cpu.kernels.load import load as load_kernels
from services.worker.backends.torch_cpu.ops import NATIVE_OPS, TORCH_OPS
from services.worker.backends.torch_cpu.quantization import int8_activations, quantize
from services.worker.model_runner import ModelRunner
from shared.config import QUANT_ACTIVATIONS, QUANTIZATIONS
from shared.models.model_files import default_model_path
from shared.wire.messages import NewSeq, SamplingParams, ScheduledSeq, Step

BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def decode_runner(loaded, batch: int, context: int, num_steps: int, pool_blocks: int = 0) -> ModelRunner:
    blocks_per_seq = -(-(context + num_steps + 8) // BLOCK_SIZE)
    dtype = loaded.model.norm.weight.dtype  # the embedding table may be kept in its blocks
    backend = TorchCpuBackend(loaded, KVSpec.of(loaded.config, BLOCK_SIZE, dtype),
                              max(batch * blocks_per_seq, pool_blocks))
    runner = ModelRunner(backend, max_model_len=8192, eos_token_ids=loaded.config.eos_token_ids)
    sampling = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    for i in range(batch):  # prefill one at a time: the step under test is the decode step
        ids = [(7 * i + j) % 1000 + 100 for j in range(context)]
        new = NewSeq(request_id=f"s{i}", token_ids=ids, num_prompt_tokens=context, num_computed_tokens=0,
                     num_new_tokens=context, block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                     sampling=sampling, reply_to="")
        runner.execute(Step(step_id=0, new_seqs=[new]))
    return runner


def decode_step(runner: ModelRunner, batch: int) -> Step:
    return Step(step_id=1, scheduled=[ScheduledSeq(f"s{i}", 1, runner.seqs[f"s{i}"].num_computed_tokens)
                                      for i in range(batch)])


def time_decode(runner: ModelRunner, batch: int, num_steps: int) -> float:
    runner.execute(decode_step(runner, batch))  # warm-up
    steps = []
    started = time.perf_counter()
    for _ in range(num_steps):
        steps.append(decode_step(runner, batch))
        runner.execute(steps[-1])
    return (time.perf_counter() - started) / num_steps


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--pool-blocks", type=int, default=0, help="KV pool size in blocks (default: just enough)")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="auto: the GGUF's own blocks, as the worker's default")
    p.add_argument("--quant-activations", default="float32", choices=QUANT_ACTIVATIONS,
                   help="the worker's --quant-activations: int8 rows into the 4- to 6-bit weights")
    p.add_argument("--compile", action="store_true", help="compile the decode layers (the worker's --compile)")
    p.add_argument("--torch-ops", action="store_true",
                   help="eager steps on torch's ops alone, not the C kernels (decode_attention.c, fused_ops.c), "
                        "as --deterministic")
    p.add_argument("--mkl", action="store_true", help="plain Linears on F.linear (MKL), not oneDNN's packed weights")
    p.add_argument("--small-pages", action="store_true", help="leave the weights where loading put them, in 4 KiB "
                   "pages where the host's THP mode is madvise (the worker moves them to huge pages)")
    p.add_argument("--profile", action="store_true", help="print the torch profiler's table for each setting")
    p.add_argument("--model-path", default=None, help="a GGUF or Hugging Face directory (default: the default model)")
    args = p.parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    batches = [int(b) for b in args.batch.split(",")]
    # one pool size for every batch: the compiled graphs are specialized to the pool's shape
    pool_blocks = max(args.pool_blocks, max(batches) * -(-(args.context + args.steps + 9) // BLOCK_SIZE))
    for dtype in args.dtype.split(","):
        ops = TORCH_OPS if args.torch_ops or not load_kernels().loaded else NATIVE_OPS
        method = "gguf" if args.quantization == "auto" else args.quantization
        loaded = load_weights(args.model_path or default_model_path(), "auto", DTYPES[dtype], ops is NATIVE_OPS, method)
        quantize(loaded.model, method, loaded.blocks, loaded.unloaded)
        if args.quant_activations == "int8":
            int8_activations(loaded.model)
        if not args.compile and not args.mkl:
            pack_linears(loaded.model)
        if not args.small_pages:
            move_to_huge_pages(loaded.model)  # as the worker's backend does
        if args.compile:
            compile_decode_layers(loaded.model, max(batches))
            warm_up(loaded.model, decode_runner(loaded, 1, BLOCK_SIZE, 1, pool_blocks).backend.kv_caches, BLOCK_SIZE)
        for batch in batches:
            runner = decode_runner(loaded, batch, args.context, args.steps + 1, pool_blocks)
            seconds = time_decode(runner, batch, args.steps)
            print(f"{dtype:8s} batch {batch:3d} context {args.context}: {seconds * 1e3:7.1f} ms/step, "
                  f"{batch / seconds:7.1f} tok/s", flush=True)
            if args.profile:
                step = decode_step(runner, batch)
                with torch.profiler.profile() as prof:
                    runner.execute(step)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
