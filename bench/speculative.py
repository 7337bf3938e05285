"""`python -m bench.speculative`: speculative decoding against the same stack without it.

    python -m bench.speculative [--spec JSON] [--num 12] [--max-tokens 128] [--concurrency 16,64]
        [--service-args "--quantization none"] [--random-draft]

One stack at a time (one worker, `make run`'s defaults), without and with --speculative-config:
greedy chat at c=1 on repetition-heavy work (rename in code, edit a JSON object, summarise a given
text) and on ordinary chat, TPOT mean and p50 over each workload's requests (with --llama-cpp, llama.cpp's
server on the same GGUF too); optionally output tok/s of the repetition-heavy chat at each --mix-concurrency; output tok/s at each --concurrency on ordinary
text; the acceptance rate per draft position from /metrics. Prints a markdown table and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import tempfile

import httpx

from bench import dataset
from bench.client import LoadSpec, run_load
from bench.cpu_flags import cpu_name
from bench.dataset import CHAT_QUESTIONS, ENGLISH, Prompt
from bench.stats import summarize
from bench.suite import llama_server_binary, wait_http
from shared.models.model_files import resolve_model_path
from switchyard.launcher import Stack
from switchyard.nats_server import NatsServer, free_port, wait_for_port

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


REPETITIVE = ("code", "json", "summary")
WORKLOADS = {"code": code_prompt, "json": json_prompt, "summary": summary_prompt,
             "chat": lambda rng: rng.choice(CHAT_QUESTIONS)}


async def measure(base_url: str, args: argparse.Namespace, c1_only: bool = False) -> dict:
    """TPOT of each workload's requests at c=1 (greedy, to the model's own end or max_tokens), then
    output tok/s of the repetition-heavy chat and of ordinary text at each concurrency."""
    spec = LoadSpec(base_url=base_url, model=MODEL, endpoint="chat", ignore_eos=False)
    out = {}
    for name, make in WORKLOADS.items():
        rng = random.Random(7)
        prompts = [Prompt(make(rng), 0, args.max_tokens) for _ in range(args.num + 1)]
        await run_load(spec, prompts[:1], concurrency=1, progress=False)  # warm-up
        results, _ = await run_load(spec, prompts[1:], concurrency=1, progress=False)
        out[name] = {"tpots_ms": [r.tpot * 1e3 for r in results if r.ok and r.num_output_tokens > 1],
                     "tokens": sum(r.num_output_tokens for r in results) / len(results),
                     "failed": sum(not r.ok for r in results)}
        print(f"  {name}: TPOT mean {statistics.fmean(out[name]['tpots_ms']):.1f} ms, p50 "
              f"{statistics.median(out[name]['tpots_ms']):.1f} ms over {out[name]['tokens']:.0f} tokens", flush=True)
    if c1_only:
        return out
    for c in (int(x) for x in args.mix_concurrency.split(",") if x):  # where speculating stops paying
        rng = random.Random(c)
        prompts = [Prompt(WORKLOADS[name](rng), 0, args.max_tokens) for _ in range(c) for name in REPETITIVE]
        results, wall = await run_load(spec, prompts, concurrency=c, progress=False)
        out[f"mix c={c}"] = {"output_tok_s": summarize(results, wall, c, float("inf"))["output_tok_s"],
                             "failed": sum(not r.ok for r in results)}
        print(f"  repetition-heavy c={c}: {out[f'mix c={c}']['output_tok_s']:.1f} output tok/s", flush=True)
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


def run_llama_cpp(args: argparse.Namespace, spec_flags: list[str]) -> dict | None:
    """llama.cpp's server on the same GGUF, one slot: the c=1 workloads (its own n-gram flags, if any)."""
    binary = llama_server_binary()
    if binary is None:
        print("llama.cpp's server is not built: run `make bench-peers` (skipped)", flush=True)
        return None
    port = free_port()
    argv = [binary, "-m", resolve_model_path(None), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
            "-c", "4096", "-t", str(os.cpu_count() or 1), "--no-webui", *spec_flags]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout=60)
        wait_http(f"http://127.0.0.1:{port}/health")
        return asyncio.run(measure(f"http://127.0.0.1:{port}", args, c1_only=True))
    finally:
        proc.terminate()
        proc.wait(30)


def run_stack(speculative: dict | None, args: argparse.Namespace) -> dict:
    bus = NatsServer(auth=True).start()
    extra = ["--speculative-config", json.dumps(speculative)] if speculative else []
    stack = Stack(nats_url=bus.url, auth_dir=bus.auth_dir, api_port=free_port(), num_workers=1,
                  service_args=["--kv-cache-memory-gib", "2", *shlex.split(args.service_args), *extra])
    stack.nats = bus
    stack.start()
    try:
        stack.wait_ready()
        return asyncio.run(measure(stack.base_url, args))
    finally:
        stack.stop()


def random_draft() -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                      tie_word_embeddings=True)
    folder = tempfile.mkdtemp(prefix="sy-random-draft-")
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def random_eagle3_head(model_path: str, folder: str | None = None, draft_vocab: int = 2048) -> str:
    """A random EAGLE-3 head for the model (a GGUF), of its dimensions, written by vLLM's speculators:
    its drafts are wrong, so the method's cost alone is measured."""
    import speculators
    import torch
    import transformers
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from services.worker.loader.gguf_file import config_of

    target = config_of(model_path)
    layer = transformers.LlamaConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_hidden_layers=1, num_attention_heads=target.num_heads, num_key_value_heads=target.num_kv_heads,
        rope_theta=target.rope_theta, rms_norm_eps=target.rms_norm_eps, max_position_embeddings=8192)
    kept = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))[:draft_vocab].sort().values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab,
        speculators_config=speculators.SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=speculators.VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    with torch.no_grad():  # speculators leaves these NaN until a verifier's are loaded
        model.embed_tokens.weight.normal_(0, 0.02)
        model.lm_head.weight.normal_(0, 0.02)
    model.load_vocab_mappings(t2d, kept - torch.arange(draft_vocab))
    folder = folder or tempfile.mkdtemp(prefix="sy-random-eagle3-")
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def _row(name: str, plain: list[float], spec: list[float], tokens: str) -> None:
    (pm, p50), (sm, s50) = ((statistics.fmean(v), statistics.median(v)) for v in (plain, spec))
    print(f"| {name} | {pm:.1f} / {p50:.1f} | {sm:.1f} / {s50:.1f} | {sm / pm:.2f}x / {s50 / p50:.2f}x | {tokens} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=json.dumps(SPEC), help="the --speculative-config measured")
    parser.add_argument("--num", type=int, default=12, help="requests per workload at c=1")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="16,64", help="throughput points (ordinary text, 64 in, 64 out)")
    parser.add_argument("--mix-concurrency", default="",
                        help="throughput points of the repetition-heavy chat (e.g. 2,4,8,16, with a --spec whose "
                             "disable_by_batch_size is above them: where speculation stops paying)")
    parser.add_argument("--llama-cpp", action="store_true", help="also llama.cpp's server (make bench-peers), c=1")
    parser.add_argument("--llama-cpp-args", default="",
                        help="its extra flags, ';' between the settings measured, e.g. ';--spec-type ngram-simple' "
                             "(without, then with its own n-gram speculation)")
    parser.add_argument("--service-args", default="", help="more flags for both stacks' services, e.g. "
                        "\"--quantization none\" (a float32 target, for a GGUF draft of the same weights)")
    parser.add_argument("--random-draft", action="store_true",
                        help="the draft_model method with a random 2-layer Llama of the model's vocabulary, saved by "
                             "transformers: every draft wrong, the method's cost alone")
    parser.add_argument("--random-eagle3", action="store_true",
                        help="the eagle3 method with a random head of the model's dimensions, written by speculators: "
                             "every draft wrong, the method's cost alone")
    args = parser.parse_args(argv)
    print(f"on {cpu_name()}", flush=True)
    measured = json.loads(args.spec)
    if args.random_draft:
        measured = {"model": random_draft(), "num_speculative_tokens": measured["num_speculative_tokens"]}
    if args.random_eagle3:
        measured = {"method": "eagle3", "model": random_eagle3_head(resolve_model_path(None)),
                    "num_speculative_tokens": measured["num_speculative_tokens"]}
    runs = {}
    for label, speculative in (("plain", None), ("spec", measured)):
        print(label, flush=True)
        runs[label] = run_stack(speculative, args)
    llamas = {}
    for flags in args.llama_cpp_args.split(";") if args.llama_cpp else []:
        print(f"llama.cpp {flags}", flush=True)
        if (llama := run_llama_cpp(args, flags.split())) is not None:
            llamas[flags.strip() or "plain"] = llama
    plain, spec = runs["plain"], runs["spec"]
    print("\n| workload (c=1) | TPOT mean / p50 plain (ms) | TPOT mean / p50 speculating (ms) | ratio of means / p50s "
          "| output tokens (plain / speculating) |")
    print("|---|---|---|---|---|")
    for name in WORKLOADS:
        _row(name, plain[name]["tpots_ms"], spec[name]["tpots_ms"], f"{plain[name]['tokens']:.0f} / "
             f"{spec[name]['tokens']:.0f}")
    _row("repetition-heavy (code, json, summary)", [t for n in REPETITIVE for t in plain[n]["tpots_ms"]],
         [t for n in REPETITIVE for t in spec[n]["tpots_ms"]], "")
    for flags, llama in llamas.items():
        print(f"\n| workload (c=1) | llama.cpp ({flags}): TPOT mean / p50 (ms) | speculating: mean / p50 over its |")
        print("|---|---|---|")
        for name in (*WORKLOADS, "repetition-heavy"):
            names = REPETITIVE if name == "repetition-heavy" else (name,)
            theirs = [t for n in names for t in llama[n]["tpots_ms"]]
            ours = [t for n in names for t in spec[n]["tpots_ms"]]
            lm, l50 = statistics.fmean(theirs), statistics.median(theirs)
            sm, s50 = statistics.fmean(ours), statistics.median(ours)
            print(f"| {name} | {lm:.1f} / {l50:.1f} | {sm / lm:.2f}x / {s50 / l50:.2f}x |")
    for key in (k for k in plain if "c=" in k):
        p, s = plain[key]["output_tok_s"], spec[key]["output_tok_s"]
        print(f"| {key} output tok/s | {p:.1f} | {s:.1f} | {s / p:.2f}x | |")
    m = spec["metrics"]
    if m.get("num_draft_tokens"):
        print(f"\nacceptance: {m['num_accepted_tokens'] / m['num_draft_tokens']:.2f} of draft tokens; per position "
              + ", ".join(f"{a:.2f}" for a in m["accepted_per_pos"]))


if __name__ == "__main__":
    main()
