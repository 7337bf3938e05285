"""A GGUF's own blocks, kept: each quantized tensor as its integer values with the file's scales
(and minimums), rather than a second quantization of the dequantized floats.

Q4_0, Q4_1, Q8_0 (here): a block is 32 weights along the input dimension. Q4_1: fp16 d, fp16 m, 16
bytes of nibbles (the low nibbles are weights 0-15, the high ones 16-31), w = d * q + m. Q4_0: fp16
d and the nibbles, w = d * (q - 8). Either is (q, scale, low) with 4-bit q and w = q * scale + low.
Q8_0: fp16 d and 32 int8 q, w = d * q: (q, scale) with 8-bit q. Every scale and low is a float16 as
the file has it. The k-quants and IQ4 (gguf_kquants.py): groups of 32 or 16 whose scales are an
int8 per group times a float16 per 256 inputs, as the file has them (IQ4_NL's a float16 per 32).
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.loader import gguf_kquants
from services.worker.loader.gguf_file import fused_rows, our_name, rows_permuted, split_rows, unpermute_rotary
from services.worker.loader.quant_blocks import BLOCK, QuantBlocks
from services.worker.model_config import ModelConfig
from shared.models.gguf_fields import read_header

_HEADER = {"Q4_0": 2, "Q4_1": 4}  # bytes before the 16 bytes of nibbles: d, or d and m
KEPT = (*_HEADER, "Q8_0", *gguf_kquants.DECODERS)


def decode(kind: str, raw: np.ndarray) -> QuantBlocks:
    """raw: [rows, row bytes], a tensor of a KEPT type as read_header gives it."""
    rows = raw.shape[0]
    if kind in gguf_kquants.DECODERS:
        f = gguf_kquants.DECODERS[kind](raw)
        low = None if f.low is None else torch.from_numpy(f.low)
        supers = None if f.supers is None else torch.from_numpy(f.supers)
        scale_dtype = torch.int8 if supers is not None else torch.float16 if f.half else torch.float32
        codebook = None if f.codebook is None else torch.from_numpy(f.codebook.copy())
        return QuantBlocks(torch.from_numpy(f.q), torch.from_numpy(f.scale), low, f.bits, f.group, scale_dtype,
                           supers=supers, codebook=codebook, span=f.span)
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
    for tensor in read_header(path).tensors:
        kind = tensor.tensor_type.name
        if kind not in KEPT or tensor.name.endswith("_exps.weight"):  # experts' stacks stay dense
            continue
        blocks = decode(kind, np.asarray(tensor.data))
        heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads} if rows_permuted(config) else {}
        for suffix, num_heads in heads.items():
            if tensor.name.endswith(suffix):
                blocks = blocks.map_rows(lambda t, n=num_heads: torch.from_numpy(
                    np.ascontiguousarray(unpermute_rotary(t.numpy(), n))))
        if fused := fused_rows(tensor.name, config):  # phi3's: split by rows, as the floats are
            for name, _ in fused:
                out[name] = blocks.map_rows(lambda t, name=name: torch.from_numpy(
                    np.ascontiguousarray(split_rows(fused, t.numpy())[name])))
            continue
        out[our_name(tensor.name)] = blocks
    if config.tie_word_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out
