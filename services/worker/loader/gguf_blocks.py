"""A GGUF's own blocks, kept: each quantized tensor as its integer values with the file's scales
(and minimums), rather than a second quantization of the dequantized floats.

Q4_0, Q4_1, Q8_0 (here): a block is 32 weights along the input dimension. Q4_1: fp16 d, fp16 m, 16
bytes of nibbles (the low nibbles are weights 0-15, the high ones 16-31), w = d * q + m. Q4_0: fp16
d and the nibbles, w = d * (q - 8). Either is (q, scale, low) with 4-bit q and w = q * scale + low.
Q8_0: fp16 d and 32 int8 q, w = d * q: (q, scale) with 8-bit q. Every scale and low is a float16 as
the file has it. The k-quants and IQ4 (gguf_kquants.py) are groups of 32 or 16 whose scales are
products of two of the file's numbers, exact in float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGUFReader

from services.worker.loader import gguf_kquants
from services.worker.loader.gguf_file import fused_rows, our_name, rows_permuted, split_rows, unpermute_rotary
from services.worker.model_config import ModelConfig

BLOCK = 32
_HEADER = {"Q4_0": 2, "Q4_1": 4}  # bytes before the 16 bytes of nibbles: d, or d and m
KEPT = (*_HEADER, "Q8_0", *gguf_kquants.DECODERS)
# after load_model fuses projections (models/llama.py), a Linear's rows are these weights' rows in order
FUSED = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
         "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3")}


@dataclass
class QuantBlocks:
    q: torch.Tensor  # [out, in]: uint8 0..15 (4 bits) or int8 (8 bits)
    scale: torch.Tensor  # [out, in / group] float32, each exact in scale_dtype
    low: torch.Tensor | None  # [out, in / group] float32, exact in scale_dtype: w = q * scale + low; or None
    bits: int = 0  # 4 or 8; 0: 4 with a low, 8 without (Q4_0 / Q4_1 / Q8_0)
    group: int = BLOCK  # inputs per scale: 32, or 16 (Q6_K, Q3_K, Q2_K)
    scale_dtype: torch.dtype = torch.float16  # how the kernel keeps scales and lows: float16 or float32

    def __post_init__(self):
        if not self.bits:
            self.bits = 8 if self.low is None else 4

    @property
    def format(self) -> tuple[int, int, torch.dtype, bool]:
        return self.bits, self.group, self.scale_dtype, self.low is not None

    @property
    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the file's weights, exactly as gguf's own dequantize computes them."""
        n, k = self.q.shape
        q = self.q.view(n, k // self.group, self.group).float()
        if self.low is None:
            return (q * self.scale[..., None]).view(n, k)
        return torch.addcmul(self.low[..., None], q, self.scale[..., None]).view(n, k)  # one rounding, as an FMA

    def with_tensors(self, q, scale, low) -> QuantBlocks:
        return dataclasses.replace(self, q=q, scale=scale, low=low)

    @staticmethod
    def cat(parts: list[QuantBlocks]) -> QuantBlocks | None:
        """Fused weights' rows in order; None where their formats differ."""
        if len({p.format for p in parts}) != 1:
            return None
        low = None if parts[0].low is None else torch.cat([p.low for p in parts])
        return parts[0].with_tensors(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), low)


def decode(kind: str, raw: np.ndarray) -> QuantBlocks:
    """raw: [rows, row bytes] as GGUFReader gives a tensor of a KEPT type."""
    rows = raw.shape[0]
    if kind in gguf_kquants.DECODERS:
        f = gguf_kquants.DECODERS[kind](raw)
        low = None if f.low is None else torch.from_numpy(f.low)
        return QuantBlocks(torch.from_numpy(f.q), torch.from_numpy(f.scale), low, f.bits, f.group,
                           torch.float16 if f.half else torch.float32)
    if kind == "Q8_0":
        blocks = raw.reshape(rows, -1, 2 + BLOCK)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return QuantBlocks(torch.from_numpy(q), torch.from_numpy(d), None)
    header = _HEADER[kind]
    blocks = raw.reshape(rows, -1, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., header:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    low = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else -8 * d
    return QuantBlocks(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(low))


def read(path: str, config: ModelConfig) -> dict[str, QuantBlocks]:
    """Every weight of a KEPT type in the file by our weight name (Q and K rows unpermuted as the
    floats are; a tied head shares the embedding's blocks)."""
    out = {}
    for tensor in GGUFReader(path).tensors:
        kind = tensor.tensor_type.name
        if kind not in KEPT or tensor.name.endswith("_exps.weight"):  # experts' stacks stay dense
            continue
        blocks = decode(kind, np.asarray(tensor.data))
        heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads} if rows_permuted(config) else {}
        for suffix, num_heads in heads.items():
            if tensor.name.endswith(suffix):
                blocks = blocks.with_tensors(*(None if t is None else
                                               torch.from_numpy(np.ascontiguousarray(unpermute_rotary(t.numpy(), num_heads)))
                                               for t in (blocks.q, blocks.scale, blocks.low)))
        if fused := fused_rows(tensor.name, config):  # phi3's: split by rows, as the floats are
            split = [split_rows(fused, t.numpy()) if t is not None else None for t in (blocks.q, blocks.scale, blocks.low)]
            for name, _ in fused:
                out[name] = blocks.with_tensors(*(None if s is None else torch.from_numpy(np.ascontiguousarray(s[name]))
                                                  for s in split))
            continue
        out[our_name(tensor.name)] = blocks
    if config.tie_word_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


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
