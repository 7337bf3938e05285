"""`python -m bench.embeddings`: /v1/embeddings throughput, the inputs batched by continuous batching.

    python -m bench.embeddings [--inputs 64 --input-len 64 --concurrency 16]

One stack of `make run`'s services on the default model; the same inputs embedded three ways: one
request carrying all of them, one request per input sent one after another, and one request per
input with `--concurrency` in flight. Reports inputs per second for each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from pathlib import Path

import httpx

from bench import dataset
from switchyard.launcher import Stack
from switchyard.nats_server import free_port


async def _post(client: httpx.AsyncClient, url: str, model: str, value) -> None:
    reply = await client.post(url, json={"model": model, "input": value, "encoding_format": "base64"})
    reply.raise_for_status()


async def measure(base_url: str, model: str, texts: list[str], concurrency: int) -> dict[str, float]:
    url = base_url + "/v1/embeddings"
    rates = {}
    async with httpx.AsyncClient(timeout=600) as client:
        await _post(client, url, model, texts)  # warm-up: the first steps of new shapes cost 3x (oneDNN's primitives)
        started = time.perf_counter()
        await _post(client, url, model, texts)
        rates["one request, every input"] = len(texts) / (time.perf_counter() - started)
        started = time.perf_counter()
        for text in texts:
            await _post(client, url, model, text)
        rates["one input a request, one at a time"] = len(texts) / (time.perf_counter() - started)
        gate = asyncio.Semaphore(concurrency)

        async def one(text: str) -> None:
            async with gate:
                await _post(client, url, model, text)

        started = time.perf_counter()
        await asyncio.gather(*(one(t) for t in texts))
        rates[f"one input a request, {concurrency} at a time"] = len(texts) / (time.perf_counter() - started)
    return rates


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = p.parse_args(argv)
    tokenizer = dataset.load(None)
    prompts = dataset.english_prompts(tokenizer, args.inputs, args.input_len, [1] * args.inputs)
    texts = [prompt.prompt for prompt in prompts]
    logs = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    stack = Stack(api_port=free_port(), log_dir=logs, service_args=["--model", args.model]).start()
    try:
        stack.wait_ready(timeout=600)
        rates = asyncio.run(measure(stack.base_url, args.model, texts, args.concurrency))
    finally:
        stack.stop()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.inputs} inputs of "
          f"{args.input_len} tokens")
    print("| how | inputs/s |\n|---|---|")
    for how, rate in rates.items():
        print(f"| {how} | {rate:.1f} |")


if __name__ == "__main__":
    main()
