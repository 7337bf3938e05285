"""`python -m bench.batch_api`: a large Batch API file beside an interactive load, on a running stack.

    python -m bench.batch_api [--base-url http://127.0.0.1:8000 --lines 10000 --concurrency 4]

1. The interactive load alone: `--interactive` streamed chat requests, `--concurrency` at a time
   (prompts of `--input-len` tokens, `--output-len` tokens out); its TTFT percentiles.
2. A batch of `--lines` chat lines (`--batch-output-len` tokens each) uploaded and started; once
   it is in progress, the same interactive load again, and the ratio of the p50 TTFTs.
3. The batch to its end: wall time, lines per second, and whether every line was answered exactly
   once (each custom_id once across the output and error files).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import time

import openai

from bench.client import LoadSpec, run_load
from bench.dataset import english_prompts, load
from bench.stats import percentiles

MODEL = "SmolLM2-135M-Instruct"


async def interactive(spec: LoadSpec, prompts, concurrency: int) -> dict:
    results, wall = await run_load(spec, prompts, concurrency=concurrency, progress=False)
    ok = [r for r in results if r.ok]
    return {"ok": len(ok), "failed": len(results) - len(ok), "wall_s": round(wall, 1),
            "ttft": percentiles([r.ttft for r in ok]), "tpot": percentiles([r.tpot for r in ok])}


async def wait_for(client: openai.AsyncOpenAI, batch_id: str, statuses: tuple[str, ...], every: float = 1.0):
    last = 0.0
    while (batch := await client.batches.retrieve(batch_id)).status not in statuses:
        if time.monotonic() - last > 30:
            last = time.monotonic()
            print(f"  batch {batch.status}: {batch.request_counts}", flush=True)
        await asyncio.sleep(every)
    return batch


async def run(args) -> dict:
    tokenizer = load()
    spec = LoadSpec(base_url=args.base_url, model=args.model, endpoint="chat")
    prompts = english_prompts(tokenizer, args.interactive, args.input_len, [args.output_len], seed=1)
    client = openai.AsyncOpenAI(base_url=args.base_url + "/v1", api_key=args.api_key, max_retries=0)
    report: dict = {"lines": args.lines, "concurrency": args.concurrency}
    await interactive(spec, prompts[:8], args.concurrency)  # warm-up
    report["alone"] = await interactive(spec, prompts, args.concurrency)
    print("alone:", report["alone"], flush=True)
    batch_prompts = english_prompts(tokenizer, args.lines, args.input_len, [args.batch_output_len], seed=2)
    lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": args.model, "max_tokens": p.max_tokens, "ignore_eos": True,
                                         "messages": [{"role": "user", "content": p.prompt}]}}) + "\n"
                    for i, p in enumerate(batch_prompts))
    data = io.BytesIO(lines.encode())
    data.name = "bench.jsonl"
    file = await client.files.create(file=data, purpose="batch")
    started = time.monotonic()
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    await wait_for(client, batch.id, ("in_progress", "completed", "failed"), every=0.2)
    report["beside_batch"] = await interactive(spec, prompts, args.concurrency)
    print("beside the batch:", report["beside_batch"], flush=True)
    report["p50_ttft_ratio"] = round(report["beside_batch"]["ttft"]["p50"] / report["alone"]["ttft"]["p50"], 2)
    batch = await wait_for(client, batch.id, ("completed", "failed", "expired", "cancelled"), every=2.0)
    wall = time.monotonic() - started
    ids = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            text = (await client.files.content(file_id)).text
            ids += [json.loads(line)["custom_id"] for line in text.split("\n") if line]
    report["batch"] = {"status": batch.status, "wall_s": round(wall, 1), "lines_per_s": round(args.lines / wall, 2),
                       "completed": batch.request_counts.completed, "failed": batch.request_counts.failed,
                       "answered_once": sorted(ids) == sorted(f"line-{i}" for i in range(args.lines))}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--batch-output-len", type=int, default=16)
    parser.add_argument("--interactive", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    print(json.dumps(asyncio.run(run(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
