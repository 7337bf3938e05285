"""`python -m bench.speculative`: n-gram speculative decoding against the same stack without it.

    python -m bench.speculative [--spec JSON] [--num 8] [--max-tokens 128] [--concurrency 16,64]

One stack at a time (one worker, `make run`'s defaults), without and with --speculative-config:
greedy chat at c=1 on repetition-heavy work (rename in code, edit a JSON object, summarise a given
text) and on ordinary chat, TPOT p50 of each; output tok/s at each --concurrency on ordinary
text; the acceptance rate per draft position from /metrics. Prints a markdown table and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import httpx

from bench import dataset
from bench.client import LoadSpec, run_load
from bench.cpu_flags import cpu_name
from bench.dataset import CHAT_QUESTIONS, ENGLISH, Prompt
from bench.stats import summarize
from switchyard.launcher import Stack
from switchyard.nats_server import NatsServer, free_port

MODEL = "SmolLM2-135M-Instruct"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
NAMES = ["total", "count", "items", "price", "weight", "result", "values", "index", "offset", "scale"]


def code_prompt(rng: random.Random) -> str:
    old, new, arg = rng.sample(NAMES, 3)
    body = "\n".join(f"    {old} = {old} + {arg}[{i}] * {rng.randint(2, 9)}" for i in range(rng.randint(6, 10)))
    code = f"def compute_{rng.choice(NAMES)}({arg}):\n    {old} = 0\n{body}\n    return {old}\n"
    return f"Rename the variable `{old}` to `{new}` in this function and return the whole function.\n\n{code}"


def json_prompt(rng: random.Random) -> str:
    record = {"id": rng.randint(1000, 9999), "name": rng.choice(["Ada", "Grace", "Alan", "Edsger"]),
              "age": rng.randint(20, 70), "city": rng.choice(["London", "Paris", "Oslo", "Lima"]),
              "tags": rng.sample(NAMES, 4), "active": rng.choice([True, False]), "score": rng.randint(0, 100)}
    return f"Return this JSON object with \"age\" increased by one, and nothing else.\n\n{json.dumps(record, indent=2)}"


def summary_prompt(rng: random.Random) -> str:
    sentences = [s.strip() + "." for s in " ".join(ENGLISH.split()).split(".") if s.strip()]
    start = rng.randrange(len(sentences) - 4)
    return "Summarise this text, quoting its key sentences.\n\n" + " ".join(sentences[start : start + 4])


WORKLOADS = {"code": code_prompt, "json": json_prompt, "summary": summary_prompt,
             "chat": lambda rng: rng.choice(CHAT_QUESTIONS)}


async def measure(base_url: str, args: argparse.Namespace) -> dict:
    """TPOT p50 of each workload at c=1 (greedy, to the model's own end or max_tokens), then output
    tok/s of ordinary text at each concurrency."""
    spec = LoadSpec(base_url=base_url, model=MODEL, endpoint="chat", ignore_eos=False)
    out = {}
    for name, make in WORKLOADS.items():
        rng = random.Random(7)
        prompts = [Prompt(make(rng), 0, args.max_tokens) for _ in range(args.num + 1)]
        await run_load(spec, prompts[:1], concurrency=1, progress=False)  # warm-up
        results, wall = await run_load(spec, prompts[1:], concurrency=1, progress=False)
        point = summarize(results, wall, 1, float("inf"))
        out[name] = {"tpot_ms": point["tpot_ms"]["p50"], "tokens": point["mean_output_tokens"],
                     "failed": point["num_failed"]}
        print(f"  {name}: TPOT p50 {out[name]['tpot_ms']:.1f} ms over {out[name]['tokens']:.0f} tokens", flush=True)
    tokenizer = dataset.load()
    throughput = LoadSpec(base_url=base_url, model=MODEL, endpoint="completions", ignore_eos=True)
    for c in (int(x) for x in args.concurrency.split(",") if x):
        prompts = dataset.english_prompts(tokenizer, 2 * c, 64, [64] * (2 * c), seed=c)
        results, wall = await run_load(throughput, prompts, concurrency=c, progress=False)
        point = summarize(results, wall, c, float("inf"))
        out[f"c={c}"] = {"output_tok_s": point["output_tok_s"], "failed": point["num_failed"]}
        print(f"  c={c}: {point['output_tok_s']:.1f} output tok/s", flush=True)
    out["metrics"] = spec_metrics(httpx.get(base_url + "/metrics", timeout=10).text)
    return out


def spec_metrics(text: str) -> dict:
    values, per_pos = {}, {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode"):
            continue
        name, value = line.split("{")[0], float(line.split()[-1])
        if 'position="' in line:
            per_pos[int(line.split('position="')[1].split('"')[0])] = value
        else:
            values[name.removeprefix("vllm:spec_decode_").removesuffix("_total")] = value
    drafts = values.get("num_drafts", 0)
    return {**values, "accepted_per_pos": [per_pos[p] / drafts for p in sorted(per_pos)] if drafts else []}


def run_stack(speculative: dict | None, args: argparse.Namespace) -> dict:
    bus = NatsServer(auth=True).start()
    extra = ["--speculative-config", json.dumps(speculative)] if speculative else []
    stack = Stack(nats_url=bus.url, auth_dir=bus.auth_dir, api_port=free_port(), num_workers=1,
                  service_args=["--kv-cache-memory-gib", "1", *extra])
    stack.nats = bus
    stack.start()
    try:
        stack.wait_ready()
        return asyncio.run(measure(stack.base_url, args))
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=json.dumps(SPEC), help="the --speculative-config measured")
    parser.add_argument("--num", type=int, default=8, help="requests per workload at c=1")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="16,64", help="throughput points (ordinary text, 64 in, 64 out)")
    args = parser.parse_args(argv)
    print(f"on {cpu_name()}", flush=True)
    runs = {}
    for label, speculative in (("plain", None), ("ngram", json.loads(args.spec))):
        print(label, flush=True)
        runs[label] = run_stack(speculative, args)
    plain, spec = runs["plain"], runs["ngram"]
    print("\n| workload | TPOT p50 plain (ms) | TPOT p50 ngram (ms) | ratio | output tokens (plain / ngram) |")
    print("|---|---|---|---|---|")
    for name in WORKLOADS:
        p, s = plain[name], spec[name]
        print(f"| {name} | {p['tpot_ms']:.1f} | {s['tpot_ms']:.1f} | {s['tpot_ms'] / p['tpot_ms']:.2f}x | "
              f"{p['tokens']:.0f} / {s['tokens']:.0f} |")
    for key in (k for k in plain if k.startswith("c=")):
        p, s = plain[key]["output_tok_s"], spec[key]["output_tok_s"]
        print(f"| {key} output tok/s | {p:.1f} | {s:.1f} | {s / p:.2f}x | |")
    m = spec["metrics"]
    if m.get("num_draft_tokens"):
        print(f"\nacceptance: {m['num_accepted_tokens'] / m['num_draft_tokens']:.2f} of draft tokens; per position "
              + ", ".join(f"{a:.2f}" for a in m["accepted_per_pos"]))


if __name__ == "__main__":
    main()
