"""Rotary position embedding's frequencies: plain, linear scaling, Llama 3's frequency scaling, and
LongRoPE's short factors (Phi-3; its long factors are not implemented, so contexts stay within the
original length, where the short ones are exact: ModelConfig.limit_context).

Configs name them two ways: transformers 4 wrote `rope_theta` beside `rope_scaling` ({"rope_type"
or "type", ...}); transformers 5 writes `rope_parameters` with `rope_theta` inside, per layer type
where the sliding-window layers rotate with a base of their own (Gemma 3's `rope_local_base_freq`
in transformers 4). Both are read;
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
    "longrope": {"factor", "short_factor", "long_factor", "attention_factor", "original_max_position_embeddings"},
}


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: list[float] | None = None  # longrope: each frequency's divisor within the original length
    long_factor: list[float] | None = None  # longrope: beyond it (not implemented: the context is capped)
    attention_factor: float | None = None  # longrope: cos and sin are multiplied by it

    def magnitude(self, max_position_embeddings: int) -> float:
        """What cos and sin are multiplied by: LongRoPE's attention factor, as transformers derives it
        where the config leaves it out (from the ratio of the context lengths); 1 for the others."""
        if self.rope_type != "longrope":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        factor = max_position_embeddings / self.original_max_position_embeddings
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.original_max_position_embeddings))


def _per_layer_type(raw: dict) -> dict | None:
    """transformers 5's rope_parameters keyed by layer type ({"full_attention": {...}, ...}), or None."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and set(params) <= {"full_attention", "sliding_attention"}:
        return params
    return None


def local_rope_theta(raw: dict, where: str) -> float | None:
    """The base the sliding-window layers rotate with where it is their own (Gemma 3); None: the
    global layers' rope. Only the default rope type is implemented for them."""
    if (by_type := _per_layer_type(raw)) is not None:
        local = dict(by_type.get("sliding_attention") or {})
        if not local:
            return None
        if local.pop("rope_type", "default") != "default" or set(local) - {"rope_theta"}:
            raise ConfigError(f"{where}: the sliding layers' rope_parameters {by_type['sliding_attention']} are "
                              "not implemented (the default rope with its own rope_theta only)")
        return float(local["rope_theta"])
    return float(raw["rope_local_base_freq"]) if raw.get("rope_local_base_freq") else None


def parse_hf_rope(raw: dict, where: str) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from a config.json's fields, in either spelling (the full-attention
    layers' where they are given per layer type)."""
    by_type = _per_layer_type(raw)
    params = dict((by_type.get("full_attention") or {}) if by_type else (raw.get("rope_parameters") or {}))
    if not params and raw.get("rope_scaling"):
        params = dict(raw["rope_scaling"])
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.pop("partial_rotary_factor", None)  # read by partial_rotary_factor()
    if rope_type == "longrope":
        params.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        params = {k: v for k, v in params.items() if v is not None}
    if rope_type not in _KEYS:
        raise ConfigError(f"{where}: rope type {rope_type!r} is not implemented (implemented: "
                          f"{', '.join(_KEYS)}); refusing to serve it with the wrong position encoding")
    extra = set(params) - _KEYS[rope_type]
    if extra:
        raise ConfigError(f"{where}: rope parameter(s) {sorted(extra)} are not implemented for rope type "
                          f"{rope_type!r}")
    if rope_type == "longrope" and not {"short_factor", "original_max_position_embeddings"} <= set(params):
        raise ConfigError(f"{where}: rope type 'longrope' needs short_factor and original_max_position_embeddings")
    if rope_type == "llama3" and set(params) != _KEYS["llama3"]:
        raise ConfigError(f"{where}: rope type 'llama3' needs {sorted(_KEYS['llama3'])}, got {sorted(params)}")
    return theta, RopeScaling(rope_type=rope_type, **params)


def partial_rotary_factor(raw: dict, where: str) -> float:
    """The share of each head that rotates (Phi-4-mini's 0.75), at the top level (transformers 4) or
    in rope_parameters (transformers 5); 1.0: the whole head."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor") or 1.0))
    if not 0.0 < factor <= 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor {factor} is out of range (0, 1]")
    return factor


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, scaled as the rope type says; on the host, also
    where a model is built on meta (an op on meta imports torch._dynamo: seconds of a worker's start)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if scaling.rope_type == "longrope":  # in transformers' order of operations: angles at long positions agree
        return 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32, device="cpu") * theta**exponents)
    base = 1.0 / (theta**exponents)
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
