"""`python -m bench.quant_linear`: the C kernels' quant_linear on a k-quant's blocks at one row,
its scales in the file's two levels (int8 x float16 per 256) against one level (float32 products),
and the two levels over int8 rows (--quant-activations int8, quant_dot.c) where the type has them.

    python -m bench.quant_linear                 # 12 layers of each type, more than the L3 holds

Random blocks of each type (gguf's layout, small float16 scales): the numbers are the same to the
bit either way (tests/test_gguf_kquants.py); this measures the time and the bytes.
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch

from bench.cpu_flags import cpu_name
from services.worker.backends.torch_cpu.kernels.load import load as load_kernels
from services.worker.backends.torch_cpu.quantization import QuantLinear
from services.worker.loader.gguf_blocks import decode
from tests.test_gguf_kquants import random_raw

SHAPES = {"Q4_K": (8192, 2048), "Q6_K": (2048, 8192), "Q5_K": (8192, 2048), "Q3_K": (8192, 2048),
          "Q2_K": (8192, 2048), "IQ4_XS": (8192, 2048)}


def _mib(layers: list[QuantLinear]) -> float:
    return sum(b.numel() * b.element_size() for layer in layers for b in layer.buffers()) / 2**20


def _int8_rows(layers: list[QuantLinear]) -> list[QuantLinear]:
    """The same layers taking int8 rows (their weights' bytes in quant_dot.c's order)."""
    copies = [copy.deepcopy(layer) for layer in layers]
    for layer in copies:
        layer.use_int8_rows()
    return copies


def _ms(layers: list[QuantLinear], x: torch.Tensor, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        for layer in layers:
            layer(x)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--types", default=",".join(SHAPES))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variant", default="", help="the kernels' instruction set (default: the best this CPU runs)")
    p.add_argument("--threads", type=int, default=0, help="torch's threads (default: as many as it has)")
    p.add_argument("--shape", default="", help="NxK for every type's layers (2048x2048 --layers 1: one layer held "
                   "in the cache, the kernel's own speed)")
    args = p.parse_args()
    kernels = load_kernels()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.variant:
        torch.ops.switchyard_cpu.use_variant(args.variant)
    print(f"{cpu_name()}, {kernels.reason}, variant {torch.ops.switchyard_cpu.variant()}, {torch.get_num_threads()} threads, {args.rows} row(s), "
          f"{args.layers} layers a type; best of 3 runs each")
    print("| type | layer | two levels ms | MiB | one level ms | MiB | time ratio | int8 rows ms | float / int8 rows |")
    print("|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for kind in args.types.split(","):
        n, k = map(int, args.shape.split("x")) if args.shape else SHAPES[kind]
        raws = [random_raw(kind, n, k, rng) for _ in range(args.layers)]
        two = [QuantLinear(decode(kind, raw), None) for raw in raws]
        one = [QuantLinear(decode(kind, raw).flat(), None) for raw in raws]
        x = torch.randn(args.rows, k)
        runs = {"two": two, "one": one, "int8": _int8_rows(two) if two[0].takes_int8_rows else []}
        times = {name: [] for name, layers in runs.items() if layers}
        for _ in range(3):
            for name in times:
                times[name].append(_ms(runs[name], x, args.reps))
        t2, t1 = min(times["two"]), min(times["one"])
        t8 = f"{min(times['int8']):.3f} | {t2 / min(times['int8']):.2f}" if "int8" in times else "- | -"
        print(f"| {kind} | {n}x{k} | {t2:.3f} | {_mib(two):.1f} | {t1:.3f} | {_mib(one):.0f} | {t2 / t1:.3f} | {t8} |")


if __name__ == "__main__":
    main()
