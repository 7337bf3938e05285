"""A file's quantized Linears on the CUDA backend (a GGUF's blocks, an AWQ / GPTQ / compressed-tensors
checkpoint's integers or FP8 codes): kept in about the file's bytes, computed by kernels/quant_gemm.py."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.backends.cuda.kernels.quant_gemm import block_k, quant_gemm
from services.worker.backends.quant_embedding import QuantEmbedding
from services.worker.loader.quant_blocks import QuantBlocks, linears_kept, parts_of


class TritonQuantLinear(nn.Module):
    """One weight's blocks: values packed along the inputs, two to a byte (4 bits: Q4's, AWQ's, IQ4's
    indices into its codebook), four (2 bits: Q2_K's), or one (8 bits: int8, FP8's e4m3 codes); Q5_K's,
    Q6_K's and Q3_K's bits above those in a plane of their own. Scales and lows per group in float32
    (float16 where the file's are), or a k-quant's two levels as the file has them (int8 per group,
    float32 d and dmin per 256 inputs); GPTQ's act-order gathers the inputs into the groups' order first."""

    def __init__(self, blocks: QuantBlocks, bias: torch.Tensor | None):
        super().__init__()
        q = blocks.q
        self.fp8 = q.dtype == torch.float8_e4m3fn
        if self.fp8:
            q = q.view(torch.uint8)
        self.out_features, self.in_features = blocks.q.shape
        width = blocks.span or blocks.bits  # the bits the values span
        self.bits = 8 if blocks.bits == 8 else 2 if width < 4 else 4  # packed in the bytes the kernel reads
        self.high = 0 if self.bits == 8 else width - self.bits  # bits above those, in the plane
        self.offset = 32 if blocks.bits == 6 else 0  # Q6_K's values are signed: kept as value + 32
        above = None
        if self.high:
            q = (q.to(torch.int16) + self.offset).to(torch.uint8)
            q, above = q & ((1 << self.bits) - 1), _plane(q >> self.bits, self.high)
        if self.bits < 8:
            q = _plane(q, self.bits)
        self.group = blocks.group
        two_levels = blocks.supers is not None
        kept = torch.int8 if two_levels else torch.float16 if blocks.scale_dtype == torch.float16 else torch.float32

        def level(t: torch.Tensor) -> torch.Tensor:  # exact: each value is one of `kept`
            return t.to(kept).contiguous()

        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("above", above)
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
        if self.bits < 8:
            q = _unplane(q, self.bits, self.in_features)
        if self.high:
            q = (q.int() | (_unplane(self.above.cpu(), self.high, self.in_features) << self.bits)) - self.offset
            q = q.to(torch.int8 if self.offset else torch.uint8)
        if self.fp8:
            q = q.view(torch.float8_e4m3fn)
        supers = None if self.d is None else torch.stack([t.cpu() for t in (self.d, self.dl) if t is not None], -1)

        def level(t: torch.Tensor | None) -> torch.Tensor | None:  # the int8 of two levels, else float32
            return None if t is None else t.cpu() if supers is not None else t.cpu().float()

        blocks = QuantBlocks(q, level(self.scales), level(self.lows), 8 if self.high else self.bits, self.group,
                             torch.float32, None if self.perm is None else self.perm.cpu(), supers,
                             None if self.codebook is None else self.codebook.cpu())
        return blocks.dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        out = quant_gemm(x, self.qweight, self.scales, self.lows, self.bits, self.group, self.fp8,
                         None if self.d is None else (self.d, self.dl), self.codebook,
                         (self.above, self.high, self.offset) if self.high else None)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _plane(values: torch.Tensor, width: int) -> torch.Tensor:
    """[out, in] values of `width` bits -> [out, in * width / 8] uint8, 8 / width inputs a byte from the lowest
    bits up (4 bits: input 2j in byte j's low nibble, 2j + 1 in its high one)."""
    per = 8 // width
    shifted = values.reshape(values.shape[0], -1, per).int() << (torch.arange(per, device=values.device) * width)
    return shifted.sum(-1).to(torch.uint8)


def _unplane(packed: torch.Tensor, width: int, k: int) -> torch.Tensor:
    """_plane's inverse: [out, k] uint8."""
    per = 8 // width
    values = (packed[..., None].int() >> (torch.arange(per) * width)) & ((1 << width) - 1)
    return values.reshape(packed.shape[0], k).to(torch.uint8)


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
            and block_k(4 if blocks.bits in (4, 5, 6) else 8, blocks.group) is not None)


def kept_linears(blocks: dict[str, QuantBlocks]) -> frozenset[str]:
    """load_model's `keep` on CUDA: each Linear the file holds in blocks, and a GGUF's embedding table."""
    return linears_kept(blocks, _fits, embedding=True)


def quantize(model: nn.Module, blocks: dict[str, QuantBlocks], unloaded: frozenset[str]) -> nn.Module:
    """Every Linear whose weights load_model left unloaded becomes a TritonQuantLinear (or parts), the
    embedding table a QuantEmbedding (its looked-up rows dequantized by torch's ops on the device)."""
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            where = f"{path}.{name}" if path else name
            parts = parts_of(blocks, where) if isinstance(child, nn.Linear) else None
            if parts is None or not child.weight.is_meta:
                continue
            runs = QuantBlocks.runs(parts)
            setattr(module, name, TritonQuantLinear(runs[0], child.bias) if len(runs) == 1
                    else TritonQuantParts(runs, child.bias))
    if "tok_embeddings.weight" in unloaded:
        model.tok_embeddings = QuantEmbedding(blocks["tok_embeddings.weight"], model.norm.weight.dtype)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"weights left unloaded after quantizing: {left[:5]}")
    return model
