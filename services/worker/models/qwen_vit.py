"""Qwen2.5-VL's image encoder: a vision transformer over each image at its own size (14-pixel
patches, 2D rotary, most layers attending within windows, a few over the whole image) and the
merger that makes each 2x2 patches one language-model token (RGB pixels -> `[tokens, hidden]`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.vision_config import QwenVisionConfig

Segments = list[tuple[int, int]]  # [start, end) runs of patches that attend to each other


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.norm1, self.norm2 = VisionRMSNorm(d), VisionRMSNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.gate_proj, self.up_proj = nn.Linear(d, cfg.intermediate_size), nn.Linear(d, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        x = x + self.proj(segment_attention(q, k, v, segments).reshape(n, d))
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [patches, heads, head_dim]; the half-split rotary, in float32 as transformers turns it."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Each segment's patches attend to each other alone; segments of one length run as one batch.
    q, k, v: [patches, heads, head_dim] -> the same."""
    out = torch.empty_like(q)
    by_length: dict[int, list[int]] = {}
    for start, end in segments:
        by_length.setdefault(end - start, []).append(start)
    for length, starts in by_length.items():
        rows = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).reshape(-1).to(q.device)
        qs, ks, vs = (t[rows].view(len(starts), length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


class QwenVisionTower(nn.Module):
    """Patches embedded (the Conv3d's two frames summed: a still image is its frame twice), in
    merge-block order; the windows' order for the layers (each window's patches contiguous), back to
    the image's order after the merger."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.config = cfg
        p = cfg.patch_size
        self.patch_weight = nn.Parameter(torch.zeros(cfg.hidden_size, 3, cfg.temporal_patch_size, p, p))
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        merged = cfg.hidden_size * cfg.merge_size**2
        self.merger_norm = VisionRMSNorm(cfg.hidden_size)
        self.merger_fc1, self.merger_fc2 = nn.Linear(merged, merged), nn.Linear(merged, cfg.out_hidden_size)

    def encode(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """images: RGB uint8 [height, width, 3], sides multiples of patch x merge -> each one's
        features [tokens, out_hidden], its tokens row by row (in one batch: the windows and whole
        images keep apart)."""
        cfg, m2 = self.config, self.config.merge_size ** 2
        patches, positions, order, windows, wholes, counts = [], [], [], [], [], []
        for image in images:
            x, hw, perm, bounds = self._image(image)
            base = sum(len(p) for p in patches)
            patches.append(x[perm.to(x.device)])
            positions.append(hw[perm])
            order.append(perm.view(-1, m2)[:, 0] // m2 + base // m2)
            windows += [(base + a, base + b) for a, b in bounds]
            wholes.append((base, base + len(x)))
            counts.append(len(x) // m2)
        x = torch.cat(patches)
        cos, sin = self._rotary(torch.cat(positions).to(x.device))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, wholes if i in cfg.full_attention_layers else windows)
        merged = self.merger_fc2(F.gelu(self.merger_fc1(self.merger_norm(x).view(-1, cfg.hidden_size * m2))))
        tokens = torch.empty_like(merged)
        tokens[torch.cat(order).to(merged.device)] = merged  # the windows' order -> each image's row-by-row order
        return list(tokens.split(counts))

    def _image(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Segments]:
        """One image's patch embeddings in merge-block order ([patches, hidden]), their (row, column)
        in patches, the permutation that makes each window contiguous, and the windows' bounds."""
        cfg, m = self.config, self.config.merge_size
        weight = self.patch_weight.sum(2)  # both frames are the image
        mean, std = torch.tensor(cfg.image_mean, device=weight.device), torch.tensor(cfg.image_std, device=weight.device)
        pixels = ((image.to(weight.device).float() / 255 - mean) / std).permute(2, 0, 1).unsqueeze(0)
        grid = F.conv2d(pixels.to(weight.dtype), weight, stride=cfg.patch_size)[0]  # [hidden, rows, cols]
        d, rows, cols = grid.shape
        blocks = (rows // m, m, cols // m, m)
        x = grid.view(d, *blocks).permute(1, 3, 2, 4, 0).reshape(-1, d)
        r = torch.arange(rows).view(rows, 1).expand(rows, cols).reshape(blocks).permute(0, 2, 1, 3).reshape(-1)
        c = torch.arange(cols).view(1, cols).expand(rows, cols).reshape(blocks).permute(0, 2, 1, 3).reshape(-1)
        perm, bounds = self._windows(rows // m, cols // m)
        return x, torch.stack([r, c], dim=-1), perm, bounds

    def _windows(self, rows: int, cols: int) -> tuple[torch.Tensor, Segments]:
        """Tokens (merged blocks) in windows of window_size pixels a side, window by window, each
        row by row: the patches' permutation, and each window's [start, end) in it."""
        cfg, m2 = self.config, self.config.merge_size ** 2
        side = cfg.window_size // cfg.token_pixels
        index = torch.arange(rows * cols).view(rows, cols)
        order, bounds, start = [], [], 0
        for top in range(0, rows, side):
            for left in range(0, cols, side):
                window = index[top:top + side, left:left + side].reshape(-1)
                order.append(window)
                bounds.append((start * m2, (start + len(window)) * m2))
                start += len(window)
        tokens = torch.cat(order)
        return (tokens.unsqueeze(1) * m2 + torch.arange(m2)).reshape(-1), bounds

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2D rotary: a head's first quarter of frequencies turned by the patch's row, its second by its column."""
        half = self.config.hidden_size // self.config.num_heads // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float32, device=positions.device) / half
        inv_freq = 1.0 / self.config.rope_theta ** exponents
        freqs = (positions.float().unsqueeze(-1) * inv_freq).flatten(1)  # [patches, head_dim / 2], in float32
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def qwen_vision_weight_name(hf_name: str) -> str | None:
    """A Qwen2.5-VL checkpoint's vision weight (`visual.`, transformers 5's modules `model.visual.`)
    -> the tower's name; None: not the tower's."""
    name = hf_name.removeprefix("model.")
    if not name.startswith("visual."):
        return None
    name = name.removeprefix("visual.")
    if name == "patch_embed.proj.weight":
        return "patch_weight"
    if name.startswith("merger."):
        return {"merger.ln_q.weight": "merger_norm.weight", "merger.mlp.0.weight": "merger_fc1.weight",
                "merger.mlp.0.bias": "merger_fc1.bias", "merger.mlp.2.weight": "merger_fc2.weight",
                "merger.mlp.2.bias": "merger_fc2.bias"}.get(name)
    if name.startswith("blocks."):
        _, idx, rest = name.split(".", 2)
        return f"blocks.{idx}.{rest.removeprefix('attn.').removeprefix('mlp.')}"
    return None
