"""A file's quantized Linears on the CUDA backend (a GGUF's blocks, an AWQ / GPTQ / compressed-tensors
checkpoint's integers): kept in about the file's bytes, computed by kernels/quant_gemm.py."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.backends.cuda.kernels.quant_gemm import block_k, quant_gemm
from services.worker.loader.quant_blocks import QuantBlocks, linears_kept, parts_of


class TritonQuantLinear(nn.Module):
    """One weight's blocks: 4-bit values two to a byte along the inputs (or int8), float32 scales and
    lows per group; GPTQ's act-order gathers the inputs into the groups' order first."""

    def __init__(self, blocks: QuantBlocks, bias: torch.Tensor | None):
        super().__init__()
        blocks = blocks.flat()  # a k-quant's two levels of scales as one (float32 products), Q5_K's in 8 bits
        q = blocks.q
        if blocks.bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        self.bits, self.group = blocks.bits, blocks.group
        self.out_features, self.in_features = blocks.q.shape
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", blocks.scale.float().contiguous())
        self.register_buffer("lows", None if blocks.low is None else blocks.low.float().contiguous())
        self.register_buffer("perm", blocks.perm)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @property
    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the weights the kernel computes with."""
        q = self.qweight
        if self.bits == 4:
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(self.out_features, self.in_features)
        blocks = QuantBlocks(q.cpu(), self.scales.cpu(), None if self.lows is None else self.lows.cpu(), self.bits,
                             self.group, torch.float32, None if self.perm is None else self.perm.cpu())
        return blocks.dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        out = quant_gemm(x, self.qweight, self.scales, self.lows, self.bits, self.group)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class TritonQuantParts(nn.Module):
    """A fused Linear (wqkv, w13) whose parts the file holds in different formats: one each, side by side."""

    def __init__(self, parts: list[QuantBlocks], bias: torch.Tensor | None):
        super().__init__()
        rows = [p.q.shape[0] for p in parts]
        biases = [None] * len(parts) if bias is None else bias.detach().split(rows)
        self.parts = nn.ModuleList(TritonQuantLinear(p, b) for p, b in zip(parts, biases, strict=True))

    @property
    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _fits(blocks: QuantBlocks) -> bool:
    """Integers in groups a tile of inputs fits (kernels/quant_gemm.py's block_k); FP8's float codes are
    dequantized here."""
    return (blocks.q.dtype != torch.float8_e4m3fn and blocks.q.shape[1] % blocks.group == 0
            and block_k(8 if blocks.codebook is not None or blocks.bits in (5, 6) else blocks.bits,  # flat()'s
                        blocks.group) is not None)


def kept_linears(blocks: dict[str, QuantBlocks]) -> frozenset[str]:
    """load_model's `keep` on CUDA: each Linear the file holds in blocks (the embedding table stays floats)."""
    return linears_kept(blocks, _fits, embedding=False)


def quantize(model: nn.Module, blocks: dict[str, QuantBlocks], unloaded: frozenset[str]) -> nn.Module:
    """Every Linear whose weights load_model left unloaded becomes a TritonQuantLinear (or parts)."""
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            where = f"{path}.{name}" if path else name
            parts = parts_of(blocks, where) if isinstance(child, nn.Linear) else None
            if parts is None or not child.weight.is_meta:
                continue
            runs = QuantBlocks.runs(parts)
            setattr(module, name, TritonQuantLinear(runs[0], child.bias) if len(runs) == 1
                    else TritonQuantParts(runs, child.bias))
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"weights left unloaded after quantizing: {left[:5]}")
    return model
