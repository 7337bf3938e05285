"""A file's quantized Linears on the CUDA backend (a GGUF's blocks, an AWQ / GPTQ / compressed-tensors
checkpoint's integers or FP8 codes): kept in about the file's bytes, computed by kernels/quant_gemm.py."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.backends.cuda.kernels.quant_gemm import block_k, quant_gemm
from services.worker.loader.quant_blocks import QuantBlocks, linears_kept, parts_of


class TritonQuantLinear(nn.Module):
    """One weight's blocks: 4-bit values (or IQ4's indices into its codebook) two to a byte along the
    inputs, else a byte a value (int8, a k-quant's 5- or 6-bit values, FP8's e4m3 codes); scales and
    lows per group in float32 (float16 where the file's are), or a k-quant's two levels as the file has
    them (int8 per group, float32 d and dmin per 256 inputs); GPTQ's act-order gathers the inputs into
    the groups' order first."""

    def __init__(self, blocks: QuantBlocks, bias: torch.Tensor | None):
        super().__init__()
        q = blocks.q
        self.fp8 = q.dtype == torch.float8_e4m3fn
        if self.fp8:
            q = q.view(torch.uint8)
        if blocks.bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        self.bits, self.group = (4 if blocks.bits == 4 else 8), blocks.group
        self.out_features, self.in_features = blocks.q.shape
        two_levels = blocks.supers is not None
        kept = torch.int8 if two_levels else torch.float16 if blocks.scale_dtype == torch.float16 else torch.float32

        def level(t: torch.Tensor) -> torch.Tensor:  # exact: each value is one of `kept`
            return t.to(kept).contiguous()

        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("codebook", blocks.codebook)
        self.register_buffer("scales", level(blocks.scale))
        self.register_buffer("lows", None if blocks.low is None else level(blocks.low))
        self.register_buffer("d", blocks.supers[..., 0].contiguous() if two_levels else None)
        self.register_buffer("dl", blocks.supers[..., 1].contiguous() if two_levels and blocks.low is not None
                             else None)
        self.register_buffer("perm", blocks.perm)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @property
    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the weights the kernel computes with."""
        q = self.qweight.cpu()
        if self.bits == 4:
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(self.out_features, self.in_features)
        if self.fp8:
            q = q.view(torch.float8_e4m3fn)
        supers = None if self.d is None else torch.stack([t.cpu() for t in (self.d, self.dl) if t is not None], -1)
        level = (lambda t: t.cpu()) if supers is not None else (lambda t: t.cpu().float())
        blocks = QuantBlocks(q, level(self.scales), None if self.lows is None else level(self.lows), self.bits,
                             self.group, torch.float32, None if self.perm is None else self.perm.cpu(), supers,
                             None if self.codebook is None else self.codebook.cpu())
        return blocks.dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        out = quant_gemm(x, self.qweight, self.scales, self.lows, self.bits, self.group, self.fp8,
                         None if self.d is None else (self.d, self.dl), self.codebook)
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
    """Integers (or FP8 codes) in groups a tile of inputs fits (kernels/quant_gemm.py's block_k)."""
    return (blocks.q.shape[1] % blocks.group == 0
            and block_k(4 if blocks.bits == 4 else 8, blocks.group) is not None)


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
