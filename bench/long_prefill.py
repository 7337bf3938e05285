"""`python -m bench.long_prefill`: first tokens of short requests that arrive behind a long prompt.

    python -m bench.long_prefill [--long 8000 --short 2 --budget 512 --threads 2]

One worker's scheduler and model runner in process (no bus), on the default model: the long prompt
starts alone, two short ones arrive after its first chunk, and the seconds from their arrival to
their first token are reported, with the prefill share (--long-prefill-token-threshold, auto) and
without it (threshold = the whole budget: the long prompt takes every step until it is done).
"""

from __future__ import annotations

import argparse
import time

import torch

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.backends.kv_pool import KVSpec
from services.worker.backends.torch_cpu.backend import TorchCpuBackend
from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from shared.models.model_files import default_model_path
from shared.wire.hashing import root_hash
from shared.wire.messages import SamplingParams, StepResult

BLOCK_SIZE = 16


def run(loaded, long_len: int, num_short: int, budget: int, threshold: int) -> dict[str, float]:
    num_blocks = (long_len + 64 * (num_short + 1)) // BLOCK_SIZE + 8
    dtype = loaded.model.tok_embeddings.weight.dtype
    runner = ModelRunner(TorchCpuBackend(loaded, KVSpec.of(loaded.config, BLOCK_SIZE, dtype), num_blocks),
                         max_model_len=long_len + 64, eos_token_ids=loaded.config.eos_token_ids)
    scheduler = Scheduler(KVCacheManager(num_blocks, BLOCK_SIZE, root_hash("bench", "auto"), enable_prefix_caching=False),
                          max_num_seqs=16, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def add(request_id: str, ids: list[int]) -> None:
        scheduler.add_request(Request(request_id, ids, params, reply_to=""))
        arrived[request_id] = time.perf_counter()

    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    add("long", [(13 * j) % 5000 + 100 for j in range(long_len)])
    step = 0
    while scheduler.has_work:
        plan = scheduler.schedule()
        sampled = []
        for iteration in runner.iterations(plan.step):
            sampled += runner.execute(iteration).sampled
        scheduler.update(plan, StepResult(step_id=plan.step.step_id, sampled=sampled))
        now = time.perf_counter()
        for s in sampled:
            first_token.setdefault(s.request_id, now)
        step += 1
        if step == 1:  # the short ones arrive once the long prompt is under way
            for i in range(num_short):
                add(f"short{i}", [(7 * i + j) % 3000 + 200 for j in range(24)])
    return {rid: first_token[rid] - arrived[rid] for rid in arrived}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", type=int, default=8000)
    parser.add_argument("--short", type=int, default=2)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(default_model_path(), ops=TORCH_OPS)
    print(f"long prompt {args.long} tokens, {args.short} short prompts of 24 tokens, budget {args.budget}")
    print("| prefill share | short requests' TTFT (s) | long request's TTFT (s) |")
    print("|---|---|---|")
    for label, threshold in (("none (the whole budget)", args.budget), ("auto (budget / 4)", 0)):
        ttft = run(loaded, args.long, args.short, args.budget, threshold)
        shorts = ", ".join(f"{ttft[f'short{i}']:.2f}" for i in range(args.short))
        print(f"| {label} | {shorts} | {ttft['long']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
