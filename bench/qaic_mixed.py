"""`python -m bench.qaic_mixed`: a mixed-length load on one model served by a paged CPU worker
alone, then by the same worker with a QAIC worker (emulated on the CPU) beside it, where the
router sends what fits the static shapes to the slots and the long prompts to the paged worker.

    python -m bench.qaic_mixed [--num-prompts 64 --concurrency 16 --long-share 0.25]

Both setups get the machine's cores: the paged worker alone takes them all; beside the QAIC
worker each takes half. Prints throughput and TTFT/TPOT per prompt class (short: fits ctx_len).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import dataset
from bench.client import LoadSpec, run_load
from bench.stats import percentiles, summarize
from shared.config import DEFAULT_MODEL_NAME
from switchyard.launcher import Stack
from switchyard.nats_server import NatsServer, free_port


def prompts(args) -> list[dataset.Prompt]:
    tokenizer = dataset.load()
    num_long = round(args.num_prompts * args.long_share)
    short = dataset.english_prompts(tokenizer, args.num_prompts - num_long, args.short_len, [args.output_len])
    long = dataset.english_prompts(tokenizer, num_long, args.long_len, [args.output_len], seed=1)
    mixed = short + long
    random.Random(0).shuffle(mixed)
    return mixed


def run_setup(args, with_qaic: bool, load: list[dataset.Prompt]) -> dict:
    cores = os.cpu_count() or 2
    threads = max(1, cores // 2) if with_qaic else cores
    log_dir = Path(tempfile.mkdtemp(prefix="bench-qaic-mixed-"))
    nats = NatsServer().start()
    stack = Stack(nats_url=nats.url, api_port=free_port(), num_workers=1, log_dir=log_dir,
                  service_args=["--kv-cache-memory-gib", "1", "--threads", str(threads)])
    stack.nats = nats
    stack.start()
    qaic = None
    try:
        stack.wait_ready(timeout=300)
        if with_qaic:
            config = {"num_cores": threads, "full_batch_size": args.slots, "ctx_len": args.ctx_len,
                      "prefill_seq_len": args.chunk, "mxfp6_matmul": True, "mxint8_kv_cache": True}
            qaic = subprocess.Popen([sys.executable, "-m", "services.worker", "--nats-url", nats.url, "--worker-id",
                                     "qaic-0", "--device", "qaic", "--qaic-config", json.dumps(config)],
                                    stdout=open(log_dir / "qaic.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
            while b"worker_ready" not in (log_dir / "qaic.log").read_bytes():
                if qaic.poll() is not None:
                    raise RuntimeError((log_dir / "qaic.log").read_text()[-2000:])
                time.sleep(0.5)
        spec = LoadSpec(base_url=stack.base_url, model=DEFAULT_MODEL_NAME)
        asyncio.run(run_load(spec, load[:2], concurrency=2, progress=False))  # warm-up
        results, wall = asyncio.run(run_load(spec, load, concurrency=args.concurrency, progress=False))
    finally:
        if qaic is not None:
            qaic.terminate()
            qaic.wait(30)
        stack.stop()
    point = summarize(results, wall, args.concurrency, float("inf"))
    for name, fits in (("short", True), ("long", False)):
        rows = [r for r, p in zip(results, load, strict=True) if r.ok and (p.num_tokens + p.max_tokens <= args.ctx_len) == fits]
        point[f"{name}_ttft_ms"] = percentiles([r.ttft for r in rows])
        point[f"{name}_tpot_ms"] = percentiles([r.tpot for r in rows])
    return point


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--short-len", type=int, default=48)
    p.add_argument("--long-len", type=int, default=400)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--ctx-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    args = p.parse_args()
    load = prompts(args)
    for with_qaic in (False, True):
        point = run_setup(args, with_qaic, load)
        label = "paged + qaic (emulated)" if with_qaic else "paged alone"
        print(f"{label:24s} {point['output_tok_s']:7.1f} tok/s  failed {point['num_failed']}  "
              f"short TTFT p50 {point['short_ttft_ms']['p50']:7.0f} ms  TPOT p50 {point['short_tpot_ms']['p50']:6.1f} ms  "
              f"long TTFT p50 {point['long_ttft_ms']['p50']:7.0f} ms  TPOT p50 {point['long_tpot_ms']['p50']:6.1f} ms",
              flush=True)


if __name__ == "__main__":
    main()
