"""`python -m bench.agreement`: how often each CPU setting's greedy answers are the reference's.

    python -m bench.agreement [--settings float32:gguf,bfloat16:gguf,float32:gguf:int8] [--max-tokens 48]

The 20 chat questions of bench/dataset.py, one at a time in process on the worker's own runner,
under each dtype:quantization[:activations] setting (the C kernels' fast path; activations as
--quant-activations, float32 unless given) and under --deterministic (torch's
ops, the weights dequantized): per setting, how many answers are the reference's token for token,
where each first differs, and the seconds the 20 took.
"""

from __future__ import annotations

import argparse
import os
import time

from bench.cpu_flags import cpu_name
from bench.dataset import CHAT_QUESTIONS
from services.worker.backends.spec import WorkerSpec
from services.worker.backends.torch_cpu.backend import TorchCpuBackend
from services.worker.model_runner import ModelRunner
from shared.models.model_files import default_model_path
from tests.model_helpers import greedy_generate

BLOCKS = 64


def runner(**settings) -> ModelRunner:
    spec = WorkerSpec(model_path=default_model_path(), kv_cache_bytes=lambda _: 0, num_kv_blocks=BLOCKS, **settings)
    backend = TorchCpuBackend.create(spec)
    return ModelRunner(backend, max_model_len=BLOCKS * backend.block_size, eos_token_ids=backend.config.eos_token_ids)


def answers(model: ModelRunner, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    started, out = time.perf_counter(), []
    for ids in prompts:
        out.append(greedy_generate(model, ids, max_tokens))
        model.seqs.clear()
    return out, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="float32:gguf,bfloat16:gguf,float32:none,bfloat16:none,float32:int8",
                   help="dtype:quantization[:activations] settings, on the C kernels")
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    from transformers import AutoTokenizer  # the model's own chat template, as the gateway renders it

    folder, name = os.path.split(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for q in CHAT_QUESTIONS]
    print(f"{cpu_name()}; {len(prompts)} questions, {args.max_tokens} greedy tokens each", flush=True)
    reference, seconds = answers(runner(deterministic=True), prompts, args.max_tokens)
    print(f"--deterministic: {seconds:.1f} s", flush=True)
    for setting in args.settings.split(","):
        dtype, quantization, activations = (setting.split(":") + ["float32"])[:3]
        got, seconds = answers(runner(dtype=dtype, quantization=quantization, quant_activations=activations),
                               prompts, args.max_tokens)
        # where two answers part; one that stops early parts where it stops
        first_differs = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b),
                              None if len(x) == len(y) else min(len(x), len(y)))
                         for x, y in zip(got, reference, strict=True)]
        same = sum(d is None for d in first_differs)
        print(f"{setting}: {same}/{len(prompts)} the reference's, first different token "
              f"{[d for d in first_differs if d is not None]}, {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
