"""`python -m bench.prefix_attention`: one layer's attention for a prefill chunk after a cached prefix, three ways.

    python -m bench.prefix_attention [--queries 1,4,16,64,256,512 --cached 0,64,512,2048,4096 --threads 2]
    python -m bench.prefix_attention --window 1024 [--softcap 50] --heads 8 --kv-heads 4 --head-dim 256

The torch CPU backend's paths (services/worker/backends/torch_cpu/attention.py): the reference's
grouped matmuls over materialized scores, and SDPA's flash kernel over the prefix and over the chunk
merged by log-sum-exp (causal SDPA alone with nothing cached); and the C kernels' prefill_attention,
each row as its decode (what the fast path runs); milliseconds a call, at SmolLM2's heads by default
(9 query, 3 KV, 64 wide). With --window or --softcap (Gemma's, Mistral's layers): the reference's
path for such a layer (SDPA with the window's mask, or the capped matmuls) against prefill_attention.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

from services.worker.backends.torch_cpu.attention import _matmul_attention, _prefill, _prefix_then_chunk
from services.worker.backends.torch_cpu.kernels.load import load


def per_call_ms(fn, *args, calls: int) -> float:
    fn(*args)
    started = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - started) / calls * 1e3


def paged(k: torch.Tensor, v: torch.Tensor, block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[1, h_kv, ctx, d] keys and values -> the pool's [blocks, h_kv, block_size, d] caches and their block ids."""
    pad = -k.shape[2] % block_size
    k, v = (F.pad(x[0], (0, 0, 0, pad)).unflatten(1, (-1, block_size)).transpose(0, 1).contiguous() for x in (k, v))
    return k, v, torch.arange(k.shape[0])


def prefill_attention(qb, k_cache, v_cache, block_ids, num_cached: int, scale: float, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    q = qb[0].transpose(0, 1)  # [nq, h, d], as the model passes it (the op copies it contiguous)
    return torch.ops.switchyard_cpu.prefill_attention(q, k_cache, v_cache, block_ids, num_cached, scale, window,
                                                      softcap)


def reference(qb, k_cache, v_cache, block_ids, num_cached: int, scale: float, window: int, softcap: float):
    """The reference's path for a windowed or capped layer, from the same paged caches."""
    return _prefill(qb[0].transpose(0, 1), k_cache, v_cache, num_cached, block_ids, scale, window or None,
                    softcap or None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", default="1,4,16,64,256,512")
    p.add_argument("--cached", default="0,64,512,2048,4096")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--window", type=int, default=0, help="a sliding window of this many keys")
    p.add_argument("--softcap", type=float, default=0.0, help="scores soft-capped at this")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, cached = getattr(torch, args.dtype), [int(c) for c in args.cached.split(",")]
    if not load().loaded:
        raise SystemExit(load().reason)
    masked = bool(args.window or args.softcap)
    ways = (f"the reference's (window {args.window}, soft cap {args.softcap:g}) / prefill_attention" if masked else
            "matmuls / flash merged (causal SDPA with nothing cached) / prefill_attention")
    print(f"ms a call, {ways}; {args.heads} heads over {args.kv_heads} KV heads of {args.head_dim}, "
          f"{args.dtype}, {torch.get_num_threads()} threads")
    print("| queries \\ cached keys | " + " | ".join(f"{c:,}" for c in cached) + " |")
    print("|---|" + "---|" * len(cached))
    for num_query in (int(q) for q in args.queries.split(",")):
        cells = []
        for num_cached in cached:
            q = torch.randn(1, args.heads, num_query, args.head_dim, dtype=dtype)
            k, v = (torch.randn(1, args.kv_heads, num_cached + num_query, args.head_dim, dtype=dtype) for _ in range(2))
            scale = args.head_dim ** -0.5
            if masked:
                caches = paged(k, v)
                cells.append(" / ".join(f"{per_call_ms(fn, q, *caches, num_cached, scale, args.window, args.softcap, calls=args.calls):.3f}"
                                        for fn in (reference, prefill_attention)))
                continue
            flash = (functools.partial(F.scaled_dot_product_attention, is_causal=True, scale=scale, enable_gqa=True)
                     if num_cached == 0 else functools.partial(_prefix_then_chunk, num_cached=num_cached, scale=scale))
            cells.append(f"{per_call_ms(_matmul_attention, q, k, v, num_cached, scale, calls=args.calls):.3f} / "
                         f"{per_call_ms(flash, q, k, v, calls=args.calls):.3f} / "
                         f"{per_call_ms(prefill_attention, q, *paged(k, v), num_cached, scale, calls=args.calls):.3f}")
        print(f"| {num_query} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
