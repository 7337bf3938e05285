"""`python -m bench.serve`: a concurrency (or request-rate) sweep against one OpenAI-compatible server.

    python -m bench.serve --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct \\
        --input-len 64 --output-len 128 --concurrency 1,4,16,64,128 --out bench/results/sy.json
    python -m bench.serve --compare bench/results/llama.json bench/results/sy.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform

from bench import dataset, report
from bench.client import LoadSpec, run_load
from bench.stats import summarize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--label", default="switchyard")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--dataset", choices=("english", "random"), default="english")
    p.add_argument("--tokenizer-path", default=None, help="GGUF or HF dir counting prompt tokens (default model)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", default="128", help="N, or LOW-HIGH drawn uniformly per request")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a system prompt every prompt shares")
    p.add_argument("--concurrency", default="1,4,16,64,128", help="comma-separated sweep")
    p.add_argument("--request-rate", default="inf", help="Poisson arrivals per second, comma-separated, or inf")
    p.add_argument("--num-prompts", type=int, default=0, help="per point (default: 4 x concurrency, at least 8)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent before each point, not measured")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (a .md table is written beside it)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print B's ratios to A and exit")
    return p.parse_args(argv)


async def sweep(args: argparse.Namespace) -> dict:
    tokenizer = dataset.load(args.tokenizer_path)
    spec = LoadSpec(base_url=args.base_url, model=args.model, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
                    api_key=args.api_key)
    points = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for rate in (float(r) for r in args.request_rate.split(",")):
            num = args.num_prompts or max(8, 4 * concurrency)
            lens = dataset.output_lengths(args.output_len, num + args.warmup, args.seed)
            make = dataset.random_prompts if args.dataset == "random" else dataset.english_prompts
            extra = {"shared_prefix_len": args.shared_prefix_len} if args.dataset == "english" else {}
            prompts = make(tokenizer, num + args.warmup, args.input_len, lens, seed=args.seed + concurrency, **extra)
            if args.warmup:
                await run_load(spec, prompts[: args.warmup], concurrency=args.warmup, progress=False)
            results, wall = await run_load(spec, prompts[args.warmup :], concurrency=concurrency,
                                           request_rate=rate, seed=args.seed, progress=args.progress)
            point = summarize(results, wall, concurrency, rate)
            points.append(point)
            print(f"c={concurrency} rate={rate}: {point['output_tok_s']:.1f} out tok/s, TTFT p50 "
                  f"{point['ttft_ms']['p50']:.1f} ms, TPOT p50 {point['tpot_ms']['p50']:.1f} ms, "
                  f"{point['num_failed']} failed", flush=True)
    return {"label": args.label, "base_url": args.base_url, "model": args.model, "endpoint": args.endpoint,
            "dataset": args.dataset, "input_len": args.input_len, "output_len": args.output_len,
            "shared_prefix_len": args.shared_prefix_len, "ignore_eos": args.ignore_eos,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {platform.node()}",
            "points": points}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare:
        print(report.compare(*args.compare))
        return
    run = asyncio.run(sweep(args))
    print(report.markdown(run))
    if args.out:
        report.save(run, args.out)


if __name__ == "__main__":
    main()
