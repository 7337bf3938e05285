"""`python -m bench.tier_copies`: the host KV tier's copies on a GPU, pinned and asynchronous against
pageable and synchronous, and how much of a save hides behind a forward.

    python -m bench.tier_copies --out $OUT/tier_copies.json

KV blocks of Llama-3.1-8B's shape by default (32 layers, 8 KV heads of 128, 16 tokens, bf16: 2 MiB
a block with K and V); `--blocks` of them saved to the tier and loaded back, each way timed with the
GPU synchronized at both ends (the median of `--repeat`), as GB/s. Then the overlap: a burst of bf16
GEMMs standing in for a step's forward, alone, and with a Step's saves started before it (the
worker's order), the time both take against the two alone. A tier whose pinning fails (memlock) is
reported as such.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.gpu_decode import timed
from services.worker.kv_tier import SHM_DIR, HostTier
from shared.checks import ConfigError


def open_tier(scope: str, tensors: list[torch.Tensor], gib: float, directory: Path | None) -> HostTier:
    try:
        return HostTier.open(scope, tensors, gib, directory=directory)
    except ConfigError:  # a small /dev/shm (a container's): the tier's file elsewhere, pinned all the same
        return HostTier.open(scope, tensors, gib, directory=Path(tempfile.mkdtemp()))


def measure(tier: HostTier, tensors: list[torch.Tensor], n: int, forward, compute: float, repeat: int) -> dict:
    """Blocks [0, n) saved to slots [0, n) and loaded back into blocks [n, 2n), then the saves beside
    the forward's stand-in."""
    saves, loads = [(b, b) for b in range(n)], [(s, n + s) for s in range(n)]

    def save():
        tier.transfer(tensors, saves, [])
        tier.settle()

    def load():
        tier.transfer(tensors, [], loads)
        tier.settle()

    def save_beside_forward():
        tier.transfer(tensors, saves, [])
        forward()
        tier.settle()

    t_save, t_load = timed(save, repeat), timed(load, repeat)
    t_both = timed(save_beside_forward, repeat)
    for t in tensors[:2]:  # the round trip is exact
        assert torch.equal(t[n:].view(torch.uint8), t[:n].view(torch.uint8))
    moved = n * tier.slot_bytes
    return {"save_gb_s": round(moved / t_save / 1e9, 2), "load_gb_s": round(moved / t_load / 1e9, 2),
            "save_ms": round(t_save * 1e3, 2), "load_ms": round(t_load * 1e3, 2),
            "save_and_forward_ms": round(t_both * 1e3, 2),
            "save_hidden": round((t_save + compute - t_both) / t_save, 3)}  # 1: wholly behind the forward


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=256, help="blocks a Step saves (and loads back)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gemm", type=int, default=8192, help="the forward's stand-in: GEMMs of this size")
    p.add_argument("--gemms", type=int, default=40)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--dir", type=Path, default=SHM_DIR if SHM_DIR.is_dir() else None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    n = args.blocks
    shape = (2 * n, args.block_size, args.kv_heads, args.head_dim)  # the pool: twice the blocks moved
    tensors = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(2 * args.layers)]
    gib = 1.1 * n * sum(t[0].numel() * t.element_size() for t in tensors) / 2**30
    report: dict = {"device": torch.cuda.get_device_name(), "blocks": n, "block_mib": None, "modes": {}}
    a = torch.randn(args.gemm, args.gemm, device="cuda", dtype=torch.bfloat16)

    def forward():
        for _ in range(args.gemms):
            a @ a

    compute = timed(forward, args.repeat)
    report["forward_ms"] = round(compute * 1e3, 2)
    for mode in ("pinned", "pageable"):
        tier = open_tier(f"bench-{mode}", tensors, gib, args.dir)
        try:
            if mode == "pageable" and tier.copies is not None:
                tier.copies.close()
                tier.copies = None
            if mode == "pinned" and tier.copies is None:
                report["modes"][mode] = "not pinned: cudaHostRegister failed (see the log)"
                continue
            report["block_mib"] = round(tier.slot_bytes / 2**20, 3)
            report["modes"][mode] = measure(tier, tensors, n, forward, compute, args.repeat)
        finally:
            tier.close()
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
