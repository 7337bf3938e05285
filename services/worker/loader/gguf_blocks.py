"""A GGUF's own blocks, kept: Q4_0, Q4_1 and Q8_0 tensors as 4-bit values with the file's scales (and
minimums), rather than a second quantization of the dequantized floats.

A block is 32 weights along the input dimension. Q4_1: fp16 d, fp16 m, 16 bytes of nibbles (the low
nibbles are weights 0-15, the high ones 16-31), w = d * q + m. Q4_0: fp16 d and the nibbles,
w = d * (q - 8). Either is (q, scale, low) with w = q * scale + low, computed in float32 exactly as
gguf's own dequantize does. Q8_0: fp16 d and 32 int8 q, w = d * q; kept as two 4-bit halves of
q + 128 side by side along the input (`folds` = 2): w = 16d * hi - 128d + d * lo, so a 4-bit kernel
fed each row twice computes with the file's 8-bit values and block scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGUFReader

from services.worker.loader.gguf_file import our_name, unpermute_rotary
from services.worker.model_config import ModelConfig

BLOCK = 32
_HEADER = {"Q4_0": 2, "Q4_1": 4}  # bytes before the 16 bytes of nibbles: d, or d and m
KEPT = (*_HEADER, "Q8_0")
# after load_model fuses projections (models/llama.py), a Linear's rows are these weights' rows in order
FUSED = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
         "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3")}


@dataclass
class Int4Blocks:
    q: torch.Tensor  # [out, in] uint8, 0..15
    scale: torch.Tensor  # [out, in / 32] float32 (the file's fp16 d)
    low: torch.Tensor  # [out, in / 32] float32: m (Q4_1) or -8 d (Q4_0)
    folds: int = 1  # 2: a Q8_0 weight's two halves side by side, [out, 2 * in] (the module docstring)

    @property
    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the file's weights, exactly (a fold's halves sum exactly in float32)."""
        n, k = self.q.shape
        groups = self.q.view(n, k // BLOCK, BLOCK).float() * self.scale[..., None] + self.low[..., None]
        return groups.view(n, self.folds, k // self.folds).sum(1)

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks | None:
        """Fused weights' rows in order; None where their formats differ."""
        if len({p.folds for p in parts}) != 1:
            return None
        return Int4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "low")), parts[0].folds)


def decode(kind: str, raw: np.ndarray) -> Int4Blocks:
    """raw: [rows, row bytes] as GGUFReader gives a Q4_0 / Q4_1 / Q8_0 tensor."""
    if kind == "Q8_0":
        return _decode_q8_0(raw)
    header = _HEADER[kind]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., header:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    low = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else -8 * d
    return Int4Blocks(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(low))


def _decode_q8_0(raw: np.ndarray) -> Int4Blocks:
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 2 + BLOCK)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    u = blocks[..., 2:].copy().view(np.int8).astype(np.int16).reshape(rows, -1) + 128  # 0..255
    q = torch.from_numpy(np.concatenate([u >> 4, u & 0x0F], axis=1).astype(np.uint8))
    return Int4Blocks(q, torch.cat([16 * d, d], 1), torch.cat([-128 * d, torch.zeros_like(d)], 1), folds=2)


def read(path: str, config: ModelConfig) -> dict[str, Int4Blocks]:
    """Every Q4_0 / Q4_1 / Q8_0 weight of the file by our weight name (Q and K rows unpermuted as the
    floats are; a tied head shares the embedding's blocks)."""
    out = {}
    for tensor in GGUFReader(path).tensors:
        kind = tensor.tensor_type.name
        if kind not in KEPT:
            continue
        blocks = decode(kind, np.asarray(tensor.data))
        heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads}
        for suffix, num_heads in heads.items():
            if tensor.name.endswith(suffix):
                blocks = Int4Blocks(*(torch.from_numpy(np.ascontiguousarray(unpermute_rotary(t.numpy(), num_heads)))
                                      for t in (blocks.q, blocks.scale, blocks.low)))
        out[our_name(tensor.name)] = blocks
    if config.tie_word_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def for_module(blocks: dict[str, Int4Blocks], path: str) -> Int4Blocks | None:
    """The blocks of a Linear at `path` (fused ones joined), or None if any part is not 4-bit."""
    for fused, parts in FUSED.items():
        if path.endswith(fused):
            prefix = path[: -len(fused)]
            found = [blocks.get(f"{prefix}{p}.weight") for p in parts]
            return None if any(b is None for b in found) else Int4Blocks.cat(found)
    return blocks.get(f"{path}.weight")
