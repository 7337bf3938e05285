"""`python -m bench.families`: tok/s of each model family at SmolLM2-135M's size, on `make run`'s defaults.

    python -m bench.families [--families llama,qwen3,gemma3 --concurrency 16 --output-len 128]

Each family's config takes SmolLM2-135M's geometry (width 576, 30 layers, 9 query and 3 KV heads
of 64, MLP 1,536, its 49,152-token vocabulary and tokenizer, tied embeddings) with random weights
saved by transformers as a Hugging Face directory, so the families differ only in what their
architecture computes (Qwen3's q/k norms; Gemma 3's four norms a layer, GeGLU and sliding windows
of 512). Each is served by a stack of its own with the same flags, and swept with bench.serve's
random prompts; the table gives each family's output tok/s and its ratio to Llama's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

from bench import serve
from shared.models.model_files import default_model_path
from switchyard.launcher import Stack
from switchyard.nats_server import free_port

SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               intermediate_size=1536, max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)
FAMILIES = {  # name: (config class, model class, its own fields)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=100000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=100000.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=512, query_pre_attn_scalar=64, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def write_family(name: str, folder: Path) -> None:
    import transformers

    config_cls, model_cls, own = FAMILIES[name]
    gguf_folder, gguf_name = os.path.split(default_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_folder, gguf_file=gguf_name)
    config = getattr(transformers, config_cls)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id, **SMOLLM2, **own)
    torch.manual_seed(0)
    getattr(transformers, model_cls)(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--families", default="llama,qwen3,gemma3")
    p.add_argument("--concurrency", default="16")
    p.add_argument("--input-len", default="64")
    p.add_argument("--output-len", default="128")
    p.add_argument("--num-prompts", default="64")
    p.add_argument("--switchyard-args", default="", help="more flags for every stack's services")
    p.add_argument("--out", default="bench/results/families.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-families-"))
    rows = {}
    for name in args.families.split(","):
        folder, logs = work / name, work / f"{name}-logs"
        write_family(name, folder)
        logs.mkdir()
        stack = Stack(api_port=free_port(), log_dir=logs,
                      service_args=["--model-path", str(folder), "--model", name, *args.switchyard_args.split()])
        try:
            stack.start().wait_ready(timeout=600)
            out = work / f"{name}.json"
            serve.main(["--base-url", stack.base_url, "--model", name, "--label", name, "--dataset", "random",
                        "--tokenizer-path", str(folder), "--input-len", args.input_len, "--output-len",
                        args.output_len, "--concurrency", args.concurrency, "--num-prompts", args.num_prompts,
                        "--no-progress", "--out", str(out)])
            rows[name] = json.loads(out.read_text())["points"][0]
        finally:
            stack.stop()
    base = rows.get("llama", {}).get("output_tok_s")
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores; c={args.concurrency}, "
          f"{args.input_len} in, {args.output_len} out")
    print("| family | output tok/s | vs llama |\n|---|---|---|")
    for name, row in rows.items():
        ratio = f"{row['output_tok_s'] / base:.2f}" if base else "-"
        print(f"| {name} | {row['output_tok_s']:.1f} | {ratio} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
