"""A quantized weight kept as a file holds it: integer values in groups along the input, a scale
(and a low) per group, w = q * scale + low: what the CPU kernels' quant_linear computes with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK = 32
SUPER = 256  # inputs per super-block of a two-level format (a k-quant's)
GROUPS = (16, 32, 64, 128)  # inputs per scale that quant_linear takes
# after load_model fuses projections (models/llama.py), a Linear's rows are these weights' rows in order
FUSED = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
         "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3")}


@dataclass
class QuantBlocks:
    # [out, in]: uint8 0..15 (4 bits: values, or a codebook's indices) or 0..31 (5), int8 -32..31 (6) or
    # any (8), or float8_e4m3fn codes
    q: torch.Tensor
    # [out, in / group] float32, each exact in scale_dtype; two levels (supers): int8, the sub-scales
    scale: torch.Tensor
    low: torch.Tensor | None  # as scale: w = q * scale + low; or None
    bits: int = 0  # 4, 5, 6 or 8; 0: 4 with a low, 8 without (Q4_0 / Q4_1 / Q8_0)
    group: int = BLOCK  # inputs per scale: 32, or 16 (Q6_K, Q3_K, Q2_K), 64 or 128 (AWQ, GPTQ ...)
    # how the kernel keeps scales and lows: float16, float32, or int8 (two levels, with supers)
    scale_dtype: torch.dtype = torch.float16
    # GPTQ's act-order: the inputs in the order the groups hold them (q's column j is input perm[j]);
    # None: in order
    perm: torch.Tensor | None = None
    # two levels (a k-quant's): [out, in / SUPER, 1 or 2] float32, each exact in float16: the
    # super-block's scale (d) and, with lows, its low (-dmin); a group's scale is its int8 times d
    supers: torch.Tensor | None = None
    # a codebook (IQ4's): [16] int8, the values q's 4-bit indices stand for; None: q holds the values
    codebook: torch.Tensor | None = None
    # the bits q's values span where fewer than `bits` (Q2_K's 2 and Q3_K's 3, kept in 4), else 0: not part
    # of the format (the CPU's kernel reads them as 4), a tighter packing's licence (the CUDA backend's)
    span: int = 0

    def __post_init__(self):
        if not self.bits:
            self.bits = 8 if self.low is None else 4

    @property
    def format(self) -> tuple[int, int, torch.dtype, bool, torch.dtype, bool]:
        return self.bits, self.group, self.scale_dtype, self.low is not None, self.q.dtype, self.codebook is not None

    def flat(self) -> QuantBlocks:
        """One level: each group's float32 scale (and low), the product of its int8 and its super's
        (exact: an 8-bit integer times an 11-bit significand); 5- and 6-bit values widened to int8, a
        codebook's indices to its values."""
        if self.codebook is not None:
            return dataclasses.replace(self, q=self.codebook[self.q.long()], bits=8, codebook=None).flat()
        if self.supers is None:
            return self
        per_super = SUPER // self.group
        scale = self.scale.float() * self.supers[..., 0].repeat_interleave(per_super, dim=1)
        low = None if self.low is None else self.low.float() * self.supers[..., 1].repeat_interleave(per_super, dim=1)
        q, bits = (self.q.to(torch.int8), 8) if self.bits in (5, 6) else (self.q, self.bits)
        return dataclasses.replace(self, q=q, bits=bits, scale=scale, low=low, scale_dtype=torch.float32, supers=None)

    @property
    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the file's weights, exactly as the format's own dequantization computes them."""
        if self.supers is not None or self.codebook is not None:
            return self.flat().dequantized
        n, k = self.q.shape
        q = self.q.view(n, k // self.group, self.group).float()
        if self.low is None:
            w = (q * self.scale[..., None]).view(n, k)
        else:
            w = torch.addcmul(self.low[..., None], q, self.scale[..., None]).view(n, k)  # one rounding, as an FMA
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantBlocks:
        """The same blocks with fn applied to each tensor by output row (q, scales, lows, supers)."""
        return dataclasses.replace(self, **{name: None if t is None else fn(t) for name, t in self._by_row().items()})

    def _by_row(self) -> dict[str, torch.Tensor | None]:
        return {"q": self.q, "scale": self.scale, "low": self.low, "supers": self.supers}

    def rows(self, start: int, stop: int) -> QuantBlocks:
        """Output rows [start, stop): a fused projection's part."""
        return self.map_rows(lambda t: t[start:stop])

    @staticmethod
    def cat(parts: list[QuantBlocks]) -> QuantBlocks | None:
        """Fused weights' rows in order; None where their formats (or input orders) differ."""
        if not all(_joinable(parts[0], p) for p in parts[1:]):
            return None
        joined = {name: None if t is None else torch.cat([p._by_row()[name] for p in parts])
                  for name, t in parts[0]._by_row().items()}
        spans = [p.span or p.bits for p in parts]
        return dataclasses.replace(parts[0], **joined, span=max(spans) if max(spans) < parts[0].bits else 0)

    @staticmethod
    def runs(parts: list[QuantBlocks]) -> list[QuantBlocks]:
        """Fused weights' parts, each run of neighbours in one format joined: Q4_K_M's Q4_K q and k
        beside a Q6_K v are two, so that a step calls the kernel twice, not three times."""
        runs = [[parts[0]]]
        for part in parts[1:]:
            if _joinable(runs[-1][0], part):
                runs[-1].append(part)
            else:
                runs.append([part])
        return [QuantBlocks.cat(run) for run in runs]


def _joinable(a: QuantBlocks, b: QuantBlocks) -> bool:
    """One format and one input order (a GPTQ act-order's permutation, or none)."""
    if a.format != b.format or (a.perm is None) != (b.perm is None):
        return False
    return a.perm is None or torch.equal(a.perm, b.perm)


def parts_of(blocks: dict[str, QuantBlocks], path: str) -> list[QuantBlocks] | None:
    """The blocks of a Linear at `path`, a fused one's parts in row order; None if a part is not kept."""
    for fused, parts in FUSED.items():
        if path.endswith(fused):
            prefix = path[: -len(fused)]
            found = [blocks.get(f"{prefix}{p}.weight") for p in parts]
            return None if any(b is None for b in found) else found
    found = blocks.get(f"{path}.weight")
    return None if found is None else [found]


def for_module(blocks: dict[str, QuantBlocks], path: str) -> QuantBlocks | None:
    """The blocks of a Linear at `path` (fused ones joined), or None if a part is not kept or their formats differ."""
    parts = parts_of(blocks, path)
    return None if parts is None else QuantBlocks.cat(parts)


# the Linears a file's blocks may stand for, by weight name (and the embedding table)
_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
            "feed_forward.w3")


def linears_kept(blocks: dict[str, QuantBlocks], fits: Callable[[QuantBlocks], bool],
                 embedding: bool) -> frozenset[str]:
    """The weights a backend builds from `blocks` rather than from floats (load_model's `keep`): each
    Linear whose every part is kept and `fits` its kernel, and, where `embedding`, the embedding
    table (unless a head tied to it could not be kept)."""
    def fit(name: str) -> bool:
        b = blocks.get(name)
        return b is not None and fits(b)

    kept = set()
    for name in blocks:
        parts = name.removesuffix(".weight").split(".")
        if parts == ["output"]:
            if fit(name):
                kept.add(name)
            continue
        linear = ".".join(parts[2:])
        if len(parts) != 4 or parts[0] != "layers" or linear not in _LINEARS:
            continue
        group = next((g for g in FUSED.values() if linear in g), (linear,))  # a fused Linear's parts go together
        if all(fit(f"layers.{parts[1]}.{p}.weight") for p in group):
            kept.add(name)
    tied = blocks.get("output.weight") is blocks.get("tok_embeddings.weight")
    if embedding and "tok_embeddings.weight" in blocks and (not tied or "output.weight" in kept):
        kept.add("tok_embeddings.weight")
    return frozenset(kept)
