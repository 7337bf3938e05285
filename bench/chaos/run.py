"""One chaos run: the stack, its lone runs, the load and the faults together, then the checks after."""

from __future__ import annotations

import asyncio
import copy
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.chaos.faults import FIXED, Fault, inject, random_schedule
from bench.chaos.load import Load, Outcome, lone_runs, specs
from bench.chaos.stack import ChaosStack, ProcessCensus

ADAPTERS = ("chaos-a", "chaos-b")
SETTLE_S = 90.0  # after the load: this long for every request and KV block to be let go


@dataclass
class ChaosResult:
    faults: list[Fault]
    outcomes: list[Outcome]
    census_before: dict[str, ProcessCensus]
    census_after: dict[str, ProcessCensus]
    num_running_after: int
    num_waiting_after: int
    kv_usage_after: float
    leftover_pids: list[int]
    squeeze_answers: list[tuple[int, int]] = field(default_factory=list)
    schedule: list[tuple[float, str]] = field(default_factory=list)
    lost_tasks: list[str] = field(default_factory=list)  # logs with "Task exception was never retrieved"


def make_adapters(folder: Path, model_path: str, base=None) -> dict[str, str]:
    """Random LoRA adapters for the real model's shapes, saved by peft (as a user's fine-tune is).
    base: transformers' model of model_path where the caller has it loaded (copied, not changed)."""
    import peft
    import torch
    import transformers

    if base is None:
        base = transformers.AutoModelForCausalLM.from_pretrained(str(Path(model_path).parent),
                                                                 gguf_file=Path(model_path).name, dtype=torch.float32)
    paths = {}
    for seed, name in enumerate(ADAPTERS):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                                 init_lora_weights=False, lora_dropout=0.0)
        peft.get_peft_model(copy.deepcopy(base), config).save_pretrained(folder / name)
        paths[name] = str(folder / name)
    return paths


def start_stack(log_dir: Path, kv_cache_gib: float = 0.25, extra_args: list[str] = (), base=None) -> ChaosStack:
    """The platform's layout on `make run`'s defaults, with two adapters from start, a KV pool small
    enough for a burst of long prompts to preempt, and a context that fits it; extra_args: more flags
    for every service (e.g. --speculative-config); base: as make_adapters takes it."""
    from shared.models.model_files import default_model_path

    adapters = make_adapters(log_dir / "adapters", default_model_path(), base)
    stack = ChaosStack(log_dir, ["--kv-cache-memory-gib", str(kv_cache_gib), "--max-model-len", "2048",
                                 "--max-loras", "2", "--lora-modules",
                                 *(f"{name}={path}" for name, path in adapters.items()), *extra_args])
    return stack.start()


def run_chaos(log_dir: Path, minutes: float, seed: int = 0, fixed: bool = False, concurrency: int = 10,
              extra_args: list[str] = ()) -> ChaosResult:
    """A stack of its own, the run, and the stack stopped: what `python -m bench.chaos` does."""
    stack = start_stack(log_dir, extra_args=extra_args)
    try:
        result = asyncio.run(run_load(stack, minutes, seed, fixed, concurrency))
    finally:
        stack.stop()
    result.leftover_pids = stack.leftovers()
    result.lost_tasks = stack.lost_tasks()
    return result


async def run_load(stack: ChaosStack, minutes: float, seed: int = 0, fixed: bool = False,
                   concurrency: int = 10) -> ChaosResult:
    """The lone runs, then the load with the faults for `minutes`, then the checks after."""
    rng = random.Random(seed)
    schedule = FIXED if fixed else random_schedule(minutes, rng)
    all_specs = specs(list(ADAPTERS))
    oracle = await lone_runs(stack.stack.base_url, all_specs)
    before = stack.census()
    load = Load([stack.stack.gateway_url(i) for i in range(2)], all_specs, oracle, rng.randrange(2**31), concurrency)
    started, faults = time.monotonic(), []
    clients = asyncio.create_task(load.run())
    await inject(stack, schedule, rng, started, faults)
    await asyncio.sleep(max(0.0, started + minutes * 60 - time.monotonic()))
    load.stopping.set()
    await clients  # each client ends its request in flight (HUNG_AFTER_S at most)
    await stack.wait_workers(stack.num_workers)  # the last fault's workers back before the checks
    stats = await _settled(stack)
    return ChaosResult(faults, load.outcomes, before, stack.census(), stats.num_running, stats.num_waiting,
                       stats.kv_cache_usage, [], stack.squeeze_answers, schedule)


async def _settled(stack: ChaosStack):
    """The scheduler's stats once nothing runs or waits and no KV block is held (or SETTLE_S passed)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        stats = await stack.stats()
        if (stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.5)
