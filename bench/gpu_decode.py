"""`python -m bench.gpu_decode`: the CUDA backend in process against the GPU's own limits.

    python -m bench.gpu_decode --config bench/configs/llama-3.1-8b.json --out $OUT/gpu.json [--hf]

Random weights for the config (bf16), then, in one run on one GPU:
- the memory bandwidth, from a device-to-device copy (the roofline's denominator);
- batch-1 decode tok/s against the roofline (the bytes every token reads: the weights but the
  embedding table, whose one row is negligible, plus its KV) over that bandwidth;
- a batch-64 decode step against its bytes floor (the weights plus every row's KV, read once);
- a prefill of `--prefill-len` tokens in TFLOP/s (2 x parameters x tokens, plus attention's);
- with `--weights int4`, every layer's Linear as a 4-bit checkpoint's (random integers in groups of
  128 with a scale and a low: AWQ's, GPTQ's or a GGUF Q4's shape) on kernels/quant_gemm.py;
- with `--hf`, transformers' generate on the same GPU and shapes (dynamic cache, then the static
  cache under torch.compile).
Steps are timed with the GPU synchronized at both ends; each figure is the median of `--repeat`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from services.worker.backends.cuda.backend import CudaBackend
from services.worker.backends.cuda.ops import TritonOps
from services.worker.backends.cuda.quant_linear import TritonQuantLinear
from services.worker.backends.kv_pool import KVSpec
from services.worker.loader import load_model
from services.worker.loader.quant_blocks import QuantBlocks
from services.worker.model_runner import ModelRunner
from shared.wire.messages import NewSeq, SamplingParams, ScheduledSeq, Step

BLOCK_SIZE = 16


def timed(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` runs, the GPU synchronized around each."""
    seconds = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def copy_bandwidth(num_bytes: int = 4 * 2**30, repeat: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (each byte read once and written once)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * num_bytes / timed(lambda: dst.copy_(src), repeat)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """What one decode token reads of the weights: all of them but the embedding table (one row);
    a quantized Linear's integers, scales and lows are buffers."""
    quantized = [t for m in model.modules() if isinstance(m, TritonQuantLinear) for t in m.buffers()]
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *quantized])
    embedding = model.tok_embeddings.weight
    tied = model.output.weight.data_ptr() == embedding.data_ptr()
    return total if tied else total - embedding.numel() * embedding.element_size()


def decode_runner(backend: CudaBackend, batch: int, context: int, num_steps: int) -> ModelRunner:
    runner = ModelRunner(backend, max_model_len=context + num_steps + 8, eos_token_ids=[])
    blocks_per_seq = -(-(context + num_steps + 8) // BLOCK_SIZE)
    sampling = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = [(7 * i + j) % 1000 + 100 for j in range(context)]
        runner.execute(Step(step_id=0, new_seqs=[NewSeq(
            request_id=f"s{i}", token_ids=ids, num_prompt_tokens=context, num_computed_tokens=0,
            num_new_tokens=context, block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            sampling=sampling, reply_to="")]))
    return runner


def decode_step_seconds(runner: ModelRunner, batch: int, repeat: int) -> float:
    def step() -> None:
        rows = [ScheduledSeq(f"s{i}", 1, runner.seqs[f"s{i}"].num_computed_tokens) for i in range(batch)]
        runner.execute(Step(step_id=1, scheduled=rows))
    step()
    return timed(step, repeat)


def kv_bytes(backend: CudaBackend, batch: int, context: int) -> int:
    return batch * context * backend.kv.bytes_per_block // backend.block_size


def int4_weights(model: torch.nn.Module, group: int = 128) -> None:
    """Every Linear of the layers as a 4-bit checkpoint's, random integers, scales and lows."""
    for module in list(model.layers.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                out, fan_in = child.weight.shape
                device = child.weight.device
                q = torch.randint(0, 16, (out, fan_in), dtype=torch.uint8, device=device)
                scale = torch.rand(out, fan_in // group, device=device) * 0.002
                blocks = QuantBlocks(q, scale, -8 * scale, 4, group, torch.float32)
                setattr(module, name, TritonQuantLinear(blocks, child.bias))
    torch.cuda.empty_cache()


def prefill_flops(model: torch.nn.Module, cfg, tokens: int) -> float:
    quantized = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, TritonQuantLinear))
    dense = quantized + sum(p.numel() for n, p in model.named_parameters() if "tok_embeddings" not in n)
    dense *= 2 * tokens
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens  # causal: QK^T and PV, halved
    return dense + attention


def hf_generate(config_path: str, batch: int, context: int, new_tokens: int, static: bool) -> float:
    """Decode tok/s of transformers' generate (random weights, same config, same GPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(100, 1000, (batch, context), device="cuda")
    kwargs = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
    if static:
        kwargs["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        model.generate(ids, **kwargs)  # compile, warm up
        short = timed(lambda: model.generate(ids, **{**kwargs, "min_new_tokens": 1, "max_new_tokens": 1}), 3)
        full = timed(lambda: model.generate(ids, **kwargs), 3)
    return batch * (new_tokens - 1) / (full - short)  # the prefill subtracted


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="bench/configs/llama-3.1-8b.json")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--weights", default="float", choices=("float", "int4"), help="int4: the layers' Linears in 4 bits")
    p.add_argument("--context", type=int, default=512, help="tokens in each sequence's KV when decoding")
    p.add_argument("--big-batch", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--hf", action="store_true", help="also time transformers' generate")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    report: dict = {"gpu": torch.cuda.get_device_name(), "config": args.config, "dtype": args.dtype, "weights": args.weights,
                    "kv_cache_dtype": args.kv_cache_dtype, "context": args.context,
                    "date": time.strftime("%Y-%m-%d"), "graphs": not args.no_graphs}
    report["bandwidth_gb_s"] = copy_bandwidth() / 1e9
    loaded = load_model(args.config, "dummy", dtype, ops=TritonOps(), device="cuda")
    if args.weights == "int4":
        int4_weights(loaded.model)
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else dtype
    blocks = (args.big_batch + 1) * -(-(args.context + args.repeat + 16) // BLOCK_SIZE)
    blocks = max(blocks, -(-args.prefill_len // BLOCK_SIZE) + 1)
    backend = CudaBackend(loaded, KVSpec.of(loaded.config, BLOCK_SIZE, kv_dtype), blocks, torch.device("cuda"),
                          capture=None if args.no_graphs else (args.big_batch, args.context + args.repeat + 16))
    report["graph_capture_s"] = backend.warm_up()
    weights = weight_bytes_per_token(loaded.model)
    report["weight_gb_per_token"] = weights / 1e9
    for batch in (1, args.big_batch):
        runner = decode_runner(backend, batch, args.context, args.repeat + 2)
        seconds = decode_step_seconds(runner, batch, args.repeat)
        floor = (weights + kv_bytes(backend, batch, args.context)) / (report["bandwidth_gb_s"] * 1e9)
        report[f"decode_b{batch}"] = {"step_ms": seconds * 1e3, "tok_s": batch / seconds, "floor_ms": floor * 1e3,
                                      "of_roofline": floor / seconds, "x_floor": seconds / floor}
        runner.seqs.clear()
    prefill = ModelRunner(backend, max_model_len=args.prefill_len + 1, eos_token_ids=[])
    ids = [(3 * j) % 1000 + 100 for j in range(args.prefill_len)]

    def run_prefill() -> None:
        prefill.seqs.clear()
        prefill.execute(Step(step_id=0, new_seqs=[NewSeq(
            request_id="p", token_ids=ids, num_prompt_tokens=len(ids), num_computed_tokens=0,
            num_new_tokens=len(ids), block_ids=list(range(-(-len(ids) // BLOCK_SIZE))),
            sampling=SamplingParams(max_tokens=1, temperature=0.0), reply_to="")]))
    run_prefill()
    seconds = timed(run_prefill, max(3, args.repeat // 4))
    report["prefill"] = {"tokens": args.prefill_len, "ms": seconds * 1e3,
                         "tflop_s": prefill_flops(loaded.model, loaded.config, args.prefill_len) / seconds / 1e12}
    if args.hf:
        del backend, prefill, loaded
        torch.cuda.empty_cache()
        report["hf_generate_b1_tok_s"] = hf_generate(args.config, 1, args.context, 64, static=False)
        torch.cuda.empty_cache()
        report["hf_static_compiled_b1_tok_s"] = hf_generate(args.config, 1, args.context, 64, static=True)
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return report


if __name__ == "__main__":
    main()
