"""Rotary position embedding's frequencies: plain, linear scaling, and Llama 3's frequency scaling.

Configs name them two ways: transformers 4 wrote `rope_theta` beside `rope_scaling` ({"rope_type"
or "type", ...}); transformers 5 writes `rope_parameters` with `rope_theta` inside. Both are read;
a rope type or parameter not implemented here is refused, never ignored (a model served with the
wrong frequencies gives wrong tokens from its first long context on, silently).
"""

from __future__ import annotations

import math

import msgspec
import torch

from shared.config import ConfigError

# the keys each rope type takes (besides rope_type/type and rope_theta)
_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def parse_hf_rope(raw: dict, where: str) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from a config.json's fields, in either spelling."""
    params = dict(raw.get("rope_parameters") or {})
    if not params and raw.get("rope_scaling"):
        params = dict(raw["rope_scaling"])
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in _KEYS:
        raise ConfigError(f"{where}: rope type {rope_type!r} is not implemented (implemented: "
                          f"{', '.join(_KEYS)}); refusing to serve it with the wrong position encoding")
    extra = set(params) - _KEYS[rope_type]
    if extra:
        raise ConfigError(f"{where}: rope parameter(s) {sorted(extra)} are not implemented for rope type "
                          f"{rope_type!r}")
    if rope_type == "llama3" and set(params) != _KEYS["llama3"]:
        raise ConfigError(f"{where}: rope type 'llama3' needs {sorted(_KEYS['llama3'])}, got {sorted(params)}")
    return theta, RopeScaling(rope_type=rope_type, **params)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, scaled as the rope type says."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return base / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(base, scaling)
    return base


def _llama3(base: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths longer than the original context / low_freq_factor are
    stretched by `factor`, shorter than it / high_freq_factor kept, and those between blended."""
    wavelen = 2 * math.pi / base
    long_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    short_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > long_wavelen, base / s.factor, base)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_between = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(is_between, blended, scaled)
