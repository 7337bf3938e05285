"""Weight-only quantization (`--quantization gguf | int4 | int8`): Linears whose weights stay 4- or
8-bit blocks, computed by the C kernels' quant_linear (w8a8, int8 activations too, is w8a8.py's)."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.backends.quant_embedding import QuantEmbedding
from services.worker.backends.torch_cpu.w8a8 import W8A8Linear
from services.worker.loader import gguf_blocks, hf_dir
from services.worker.loader.quant_blocks import BLOCK, GROUPS, SUPER, QuantBlocks, linears_kept, parts_of
from shared.config import FILES_OWN

PANEL = 16  # output columns the kernel reads side by side (quant_linear.c)
KEEPS_BLOCKS = ("int4", *FILES_OWN)  # the quantizations that keep a file's blocks
SMALLEST_SCALE = 2.0**-24  # float16's smallest


def fits(out_features: int, in_features: int, group: int = BLOCK) -> bool:
    return out_features % PANEL == 0 and group in GROUPS and in_features % group == 0


def _to_panels(t: torch.Tensor) -> torch.Tensor:
    """[n, columns] -> [n / 16, columns, 16]: each input's 16 outputs of a panel side by side."""
    n, columns = t.shape
    return t.reshape(n // PANEL, PANEL, columns).transpose(1, 2).contiguous()


def _from_panels(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, t.shape[1])


class QuantLinear(nn.Module):
    """A Linear whose weight is 4- or 8-bit groups of 16 to 128 inputs, in quant_linear.c's layout.

    - gguf (the default on a GGUF with quantized tensors of a kept type): exactly those weights keep
      the file's blocks (loader/gguf_blocks.py: Q4_0 / Q4_1 / Q8_0 with their float16 scales; the
      k-quants and IQ4 in loader/gguf_kquants.py, in the file's two levels of scales, an int8 per group
      times a float16 per 256 inputs, IQ4's values as the file's 4-bit indices into its codebook); the
      others stay as the file has them.
    - int4: 4-bit values in groups of 32 inputs, each with a float16 scale and minimum (Q4_1's
      scheme); a GGUF's own blocks where the file has them, 8 bits for a weight it holds as floats.
    - int8: 8-bit values in groups of 32 with a float16 scale each (Q8_0's scheme).
    - awq, gptq, compressed-tensors (the default on such a checkpoint): its Linears keep the file's
      integers (or FP8's float8 e4m3 codes), float32 scales and lows (loader/hf_quant.py).
    quant_linear.c computes each output as one float32 sum over the inputs in order, at every batch
    size, on weights equal to the bit to what gguf's own dequantize gives (gguf_kquants.py says
    why). So a row's result does not depend on its batch, and the
    only difference from --deterministic (the same weights dequantized once, on torch's matmul) is
    the order of the sums. A bfloat16 model's rows are widened to float32, its outputs rounded back."""

    def __init__(self, blocks: QuantBlocks, bias: torch.Tensor | None):
        super().__init__()
        n, k = blocks.q.shape
        if not fits(n, k, blocks.group):
            raise ValueError(f"quant_linear takes [n, k] weights with n a multiple of {PANEL} and k of "
                             f"{blocks.group}, got [{n}, {k}]")
        self.bits, self.group, self.out_features, self.in_features = blocks.bits, blocks.group, n, k
        codes = blocks.q.dtype
        q = _to_panels(blocks.q.view(torch.uint8) if codes == torch.float8_e4m3fn else blocks.q)  # [n / 16, k, 16]
        if self.bits in (4, 5, 6):  # [n / 16, k / 2, 16]: input 2j in the low nibbles, 2j + 1 in the high ones
            if self.bits == 6:  # -32..31 as 0..63
                q = (q.to(torch.int16) + 32).to(torch.uint8)
            q = _pairs(q, self.bits)
        self.register_buffer("qweight", q.contiguous().view(codes) if codes == torch.float8_e4m3fn else q.contiguous())
        self.register_buffer("scales", _to_panels(blocks.scale).to(blocks.scale_dtype))
        self.register_buffer("lows", None if blocks.low is None else _to_panels(blocks.low).to(blocks.scale_dtype))
        supers = None  # two levels: [n / 16, k / 256, 1 or 2, 16] float16
        if blocks.supers is not None:
            supers = _to_panels(blocks.supers.reshape(n, -1)).half().view(n // PANEL, -1, blocks.supers.shape[-1], PANEL)
        self.register_buffer("supers", supers)
        self.register_buffer("perm", blocks.perm)  # GPTQ's act-order: the inputs gathered into the groups' order
        self.register_buffer("codebook", blocks.codebook)  # IQ4's: the values the 4-bit indices stand for
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.int8_activations = False  # rows quantized to int8, qweight in quant_dot.c's order: use_int8_rows()

    @property
    def takes_int8_rows(self) -> bool:
        """quant_dot.c's formats: 4-, 5- and 6-bit integers (not IQ4's codebook indices, 8 bits or FP8),
        over inputs in blocks of 32."""
        return self.bits in (4, 5, 6) and self.codebook is None and self.in_features % 32 == 0

    @property
    def row_block(self) -> int:
        """The inputs one int8 row scale covers (quant_dot.c): a k-quant's super-block (256, llama.cpp's
        Q8_K), else 32 (Q8_0's)."""
        return SUPER if self.supers is not None else 32

    def use_int8_rows(self) -> None:
        """--quant-activations int8: the rows quantized to int8 per `row_block` inputs (quant_dot.c), the
        weights' bytes put in its order (four inputs of a column side by side: the same bytes, another order)."""
        if not self.takes_int8_rows:
            raise ValueError(f"no int8-activation kernel for {self.bits}-bit weights"
                             f"{' (codebook indices)' if self.codebook is not None else ''}")
        if not self.int8_activations:
            self.qweight = _fours(self._unsigned(), self.bits)
            self.int8_activations = True

    def _unsigned(self) -> torch.Tensor:
        """4-, 5- and 6-bit weights' stored values (6 bits: value + 32) as [n / 16, k, 16] bytes."""
        return (_from_fours if self.int8_activations else _from_pairs)(self.qweight, self.in_features, self.bits)

    @classmethod
    def quantize(cls, linear: nn.Linear, bits: int) -> QuantLinear:
        """Our own blocks of a float weight: 4 bits asymmetric (Q4_1's scheme), 8 bits symmetric (Q8_0's)."""
        n, k = linear.weight.shape
        groups = linear.weight.detach().float().view(n, k // BLOCK, BLOCK)
        if bits == 4:
            low = groups.amin(-1).half().float()
            scale = ((groups.amax(-1) - low) / 15).clamp(min=SMALLEST_SCALE).half().float()
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        else:
            low = None
            scale = (groups.abs().amax(-1) / 127).clamp(min=SMALLEST_SCALE).half().float()
            q = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(QuantBlocks(q.view(n, k), scale, low), linear.bias)

    @property
    def blocks(self) -> QuantBlocks:
        """The weight back as blocks: [n, k] values, [n, k / 32] scales (and lows)."""
        q = self.qweight
        if self.bits in (4, 5, 6):
            q = self._unsigned()
            if self.bits == 6:
                q = (q.to(torch.int16) - 32).to(torch.int8)
        as_kept = (lambda t: t) if self.supers is not None else (lambda t: t.float())  # int8 subs stay int8
        low = None if self.lows is None else as_kept(_from_panels(self.lows))
        supers = None
        if self.supers is not None:
            per_super = self.supers.shape[2]
            supers = _from_panels(self.supers.flatten(1, 2)).float().view(self.out_features, -1, per_super)
        # float8 codes are moved as bytes
        q = _from_panels(q.view(torch.uint8)).view(q.dtype) if q.dtype == torch.float8_e4m3fn else _from_panels(q)
        return QuantBlocks(q, as_kept(_from_panels(self.scales)), low,
                           self.bits, self.group, self.scales.dtype, self.perm, supers, self.codebook)

    @property
    def dequantized(self) -> torch.Tensor:
        """The weight as [out, in] float32, the values the kernel computes with."""
        return self.blocks.dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers  # one read, not nn.Module.__getattr__'s lookup per buffer (docs/benchmarks.md, 57th VM)
        if b["perm"] is not None:
            x = x.index_select(-1, b["perm"])
        return torch.ops.switchyard_cpu.quant_linear(x, b["qweight"], b["scales"], b["lows"], self.bits, self.bias,
                                                     b["supers"], b["codebook"], self.int8_activations)


def _pairs(u: torch.Tensor, bits: int) -> torch.Tensor:
    """[n / 16, k, 16] stored values -> quant_linear.c's bytes: the nibbles two inputs to a byte, then
    the bits past the fourth."""
    pairs = (u & 0x0F).view(u.shape[0], -1, 2, PANEL)
    nibbles = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    return nibbles if bits == 4 else torch.cat([nibbles, _high_bits(u, bits - 4)], dim=1)


def _from_pairs(q: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    nibbles = q[:, : k // 2]
    u = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=2).view(q.shape[0], -1, PANEL)
    return u if bits == 4 else u | (_from_high_bits(q[:, k // 2:], bits - 4) << 4)


def _fours(u: torch.Tensor, bits: int) -> torch.Tensor:
    """[n / 16, k, 16] stored values -> quant_dot.c's bytes (its header draws them): per 8 inputs, 64
    bytes, byte 4c + j column c's at input j (low nibble) and j + 4 (high); then the bits past the
    fourth (width w), per 32 / w inputs 64 bytes, byte 4c + j column c's at inputs 4t + j in bits w t."""
    panels, k, _ = u.shape
    steps = (u & 0x0F).view(panels, k // 8, 2, 4, PANEL).permute(0, 1, 4, 3, 2)  # [.., column, j, half]
    nibbles = (steps[..., 0] | (steps[..., 1] << 4)).reshape(panels, k // 2, PANEL)
    if bits == 4:
        return nibbles.contiguous()
    width = bits - 4
    fields = ((u >> 4) & ((1 << width) - 1)).view(panels, k // (32 // width), 8 // width, 4, PANEL).permute(0, 1, 4, 3, 2)
    shifts = torch.arange(8 // width, dtype=torch.uint8) * width
    high = (fields << shifts).sum(-1, dtype=torch.uint8).reshape(panels, -1, PANEL)
    return torch.cat([nibbles, high], dim=1).contiguous()


def _from_fours(q: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    panels = q.shape[0]
    steps = q[:, : k // 2].reshape(panels, k // 8, PANEL, 4)
    u = torch.stack([steps & 0x0F, steps >> 4], dim=-1).permute(0, 1, 4, 3, 2).reshape(panels, k, PANEL)
    if bits == 4:
        return u
    width = bits - 4
    high = q[:, k // 2:].reshape(panels, k // (32 // width), PANEL, 4, 1)
    shifts = torch.arange(8 // width, dtype=torch.uint8) * width
    fields = (high >> shifts) & ((1 << width) - 1)  # [.., column, j, t]
    return u | (fields.permute(0, 1, 4, 3, 2).reshape(panels, k, PANEL) << 4)


def _high_bits(q: torch.Tensor, width: int) -> torch.Tensor:
    """[n / 16, k, 16] values -> their bits past the fourth (`width` of them), [n / 16, k * width / 8,
    16] bytes: byte c of row r holds column c's at the row's 8 / width inputs, input t of the row at
    bits t * width (quant_linear.c's layout)."""
    per_row = 8 // width
    high = ((q >> 4) & ((1 << width) - 1)).view(q.shape[0], -1, per_row, PANEL)
    shifts = (torch.arange(per_row, dtype=torch.uint8) * width).view(1, 1, per_row, 1)
    return (high << shifts).sum(2, dtype=torch.uint8)


def _from_high_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """_high_bits' bytes -> [n / 16, k, 16] values of `width` bits."""
    per_row = 8 // width
    shifts = (torch.arange(per_row, dtype=torch.uint8) * width).view(1, 1, per_row, 1)
    return ((packed[:, :, None, :] >> shifts) & ((1 << width) - 1)).reshape(packed.shape[0], -1, PANEL)


class QuantLinearParts(nn.Module):
    """A fused Linear (wqkv, w13) whose parts the file holds in different formats (Q4_K_M's Q4_K q and
    k beside a Q6_K v): a QuantLinear each run of one format (QuantBlocks.runs), their outputs side by side."""

    def __init__(self, parts: list[QuantBlocks], bias: torch.Tensor | None):
        super().__init__()
        rows = [p.q.shape[0] for p in parts]
        biases = [None] * len(parts) if bias is None else bias.detach().split(rows)
        self.parts = nn.ModuleList(QuantLinear(p, b) for p, b in zip(parts, biases, strict=True))
        self.out_features, self.in_features = sum(rows), parts[0].q.shape[1]

    @property
    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def int8_activations(model: nn.Module) -> int:
    """--quant-activations int8: each Linear of 4-, 5- or 6-bit blocks quantizes its rows to int8 (per 256
    inputs for a k-quant, else 32), as llama.cpp does (quant_dot.c); the others keep float32 rows. How many
    take int8 rows."""
    taking = [m for m in model.modules() if isinstance(m, QuantLinear) and m.takes_int8_rows]
    for module in taking:
        module.use_int8_rows()
    return len(taking)


def kept_weights(blocks: dict[str, QuantBlocks]) -> frozenset[str]:
    """The weights quantize() builds from `blocks` (load_model's `keep`): each Linear whose every part
    fits quant_linear, and the embedding table (QuantEmbedding)."""
    return linears_kept(blocks, lambda b: fits(*b.q.shape, b.group), embedding=True)


def quantize(model: nn.Module, method: str, blocks: dict[str, QuantBlocks] | None = None,
             unloaded: frozenset[str] = frozenset()) -> nn.Module:
    """Every Linear that fits the kernel's layout, the output head included, becomes a quantized one
    (the embedding table stays). `blocks` (a GGUF with tensors of a kept type): those weights keep
    the file's own blocks; under `gguf` (--quantization auto's pick) a weight the file holds as floats
    stays as it is (so under a checkpoint's own awq, gptq or compressed-tensors), under int4 it becomes
    8-bit blocks."""
    if method == "none":
        return model
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                where = f"{path}.{child_name}" if path else child_name
                setattr(module, child_name, _quantized(child, method, blocks, where))
    if "tok_embeddings.weight" in unloaded:
        model.tok_embeddings = QuantEmbedding(blocks["tok_embeddings.weight"], model.norm.weight.dtype)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"weights left unloaded after quantizing: {left[:5]}")
    return model


def _quantized(linear: nn.Linear, method: str, blocks: dict | None, path: str) -> nn.Module:
    if method == "w8a8":
        return W8A8Linear(linear)
    parts = parts_of(blocks, path) if blocks is not None and method in KEEPS_BLOCKS else None
    if parts is not None and all(fits(*p.q.shape, p.group) for p in parts):
        runs = QuantBlocks.runs(parts)
        return QuantLinear(runs[0], linear.bias) if len(runs) == 1 else QuantLinearParts(runs, linear.bias)
    if method in FILES_OWN or not fits(linear.out_features, linear.in_features):
        return linear
    return QuantLinear.quantize(linear, 4 if method == "int4" and blocks is None else 8)


def native_blocks(loaded, method: str) -> dict[str, QuantBlocks] | None:
    """A file's own blocks under a method that keeps them: a GGUF's of a kept type
    (loader/gguf_blocks.py), a quantized checkpoint's (loader/hf_dir.py)."""
    kind, _, path = loaded.source.partition(":")
    if method not in KEEPS_BLOCKS or kind not in ("gguf", "hf"):
        return None
    return (gguf_blocks.read(path, loaded.config) if kind == "gguf" else hf_dir.read_blocks(path)) or None
