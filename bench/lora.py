"""`python -m bench.lora`: decode tok/s of a batch of base rows against the same batch with every row
on one of N LoRA adapters, on the worker's runner with `make run`'s CPU defaults (eager steps).

    python -m bench.lora [--concurrency 16 --adapters 8 --rank 8 --steps 32]

The adapters are random, saved by peft for SmolLM2's shapes on every projection (q/k/v/o and
gate/up/down). Also reports an adapter's load time (files read, checked, moved to host memory)
and its bytes, and the time a slot takes to be filled. Rows are spread round-robin over adapters.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from services.worker.backends.spec import WorkerSpec
from services.worker.backends.torch_cpu.backend import TorchCpuBackend
from services.worker.backends.torch_cpu.kernels.load import load as load_kernels
from services.worker.lora.manager import LoraLimits, LoraManager
from services.worker.model_runner import ModelRunner
from shared.engine_defaults import pick
from shared.models.gguf_fields import read_fields
from shared.models.model_files import default_model_path
from shared.wire.messages import NewSeq, SamplingParams, ScheduledSeq, Step

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(folder: Path, count: int, rank: int) -> list[str]:
    import peft
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        peft_model = peft.get_peft_model(model, config)
        peft_model.save_pretrained(folder / f"a{i}")
        model = peft_model.unload()
        paths.append(str(folder / f"a{i}"))
    return paths


def runner_on_defaults(max_loras: int, rank: int) -> tuple[ModelRunner, str]:
    path = default_model_path()
    kernels = load_kernels()
    defaults = pick(read_fields(path)["__tensor_types__"], kernels=None if kernels.loaded else kernels.reason,
                    compile=False)
    spec = WorkerSpec(model_path=path, kv_cache_bytes=lambda _: 2**30, dtype=defaults.dtype.value,
                      quantization=defaults.quantization.value)
    backend = TorchCpuBackend.create(spec)
    lora = LoraManager(backend.model, backend.config, LoraLimits(max_loras, rank))
    runner = ModelRunner(backend, 8192, backend.config.eos_token_ids, lora=lora)
    return runner, backend.describe().device


def decode_tok_s(runner: ModelRunner, adapters: list[str | None], prompt_len: int, steps: int, tag: str) -> float:
    """Prefill one prompt per row, then `steps` decode steps of every row; tok/s of the decode steps."""
    blocks_per_row = (prompt_len + steps + 2 + 15) // 16
    new = [NewSeq(request_id=f"{tag}{i}", token_ids=[(7 * i + j) % 4000 + 100 for j in range(prompt_len)],
                  num_prompt_tokens=prompt_len, num_computed_tokens=0, num_new_tokens=prompt_len,
                  block_ids=list(range(i * blocks_per_row, (i + 1) * blocks_per_row)),
                  sampling=SamplingParams(max_tokens=steps + 2, ignore_eos=True), reply_to="", lora=lora)
           for i, lora in enumerate(adapters)]
    runner.execute(Step(step_id=0, new_seqs=new))
    started = time.perf_counter()
    for s in range(steps):
        runner.execute(Step(step_id=s + 1, scheduled=[ScheduledSeq(n.request_id, 1, prompt_len + s) for n in new]))
    seconds = time.perf_counter() - started
    runner.execute(Step(step_id=steps + 1, dropped_ids=[n.request_id for n in new]))
    return len(adapters) * steps / seconds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="base and LoRA runs alternate; the best of each is kept")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(Path(tmp), args.adapters, args.rank)
        runner, device = runner_on_defaults(args.adapters, args.rank)
        started = time.perf_counter()
        adapters = [runner.lora.add(f"a{i}", path) for i, path in enumerate(paths)]
        load_s = (time.perf_counter() - started) / len(paths)
        rows_lora = [f"a{i % args.adapters}" for i in range(args.concurrency)]
        decode_tok_s(runner, rows_lora, args.prompt_len, 4, "warm")  # fills the slots
        base, lora = 0.0, 0.0
        for r in range(args.rounds):
            base = max(base, decode_tok_s(runner, [None] * args.concurrency, args.prompt_len, args.steps, f"b{r}-"))
            lora = max(lora, decode_tok_s(runner, rows_lora, args.prompt_len, args.steps, f"l{r}-"))
    slot_bytes = sum(m.a[0].numel() * m.a.element_size() + m.b[0].numel() * m.b.element_size()
                     for m in runner.lora.layers.values())
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores; worker: {device}")
    print(f"c={args.concurrency}, {args.adapters} adapters of rank {args.rank} on every projection, "
          f"prompt {args.prompt_len}, {args.steps} decode steps, best of {args.rounds}")
    print(f"base model:        {base:8.1f} tok/s")
    print(f"each row adapted:  {lora:8.1f} tok/s  ({lora / base:.2f}x the base)")
    print(f"adapter load:      {load_s * 1000:8.1f} ms   host memory {adapters[0].num_bytes / 2**20:.2f} MiB (float32), "
          f"slot {slot_bytes / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
