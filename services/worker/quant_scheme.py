"""A quantized checkpoint's `quantization_config` (AWQ, GPTQ, compressed-tensors): what this engine
serves of it, checked once; anything else is refused by name, never loaded as something else."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import CHECKPOINT_QUANTIZATIONS, ConfigError

# compressed-tensors' formats: int4/int8 packed in int32 words, int8 as it is, fp8 as it is
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
# compressed-tensors fields that change the computation and are not implemented here
_CT_REFUSED = ("sparsity_config", "transform_config", "kv_cache_scheme")


@dataclass(frozen=True)
class QuantScheme:
    method: str  # one of CHECKPOINT_QUANTIZATIONS
    bits: int  # awq / gptq: the one width; compressed-tensors: read from each module's tensors (0)
    v1_zeros: bool  # gptq's original format stores each zero point minus one
    activations: str  # what the checkpoint asks of activations, and what this engine does ("" for none)


def _int(config: dict, key: str, default: int, where: str) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{where}: quantization_config.{key} must be an integer, got {value!r}")
    return value


def _awq(config: dict, where: str) -> QuantScheme:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"{where}: AWQ version {version!r} is not implemented (the GEMM packing, AutoAWQ's "
                          "default, is); convert the checkpoint to GEMM")
    if not config.get("zero_point", True):
        raise ConfigError(f"{where}: AWQ without zero points is not implemented (zero_point: true is)")
    bits = _int(config, "bits", 4, where)
    if bits != 4:
        raise ConfigError(f"{where}: AWQ with {bits} bits is not implemented (4 is)")
    _int(config, "group_size", 128, where)  # each module's scales say it again
    return QuantScheme("awq", 4, False, "")


def _gptq(config: dict, where: str) -> QuantScheme:
    bits = _int(config, "bits", 4, where)
    if bits not in (4, 8):
        raise ConfigError(f"{where}: GPTQ with {bits} bits is not implemented (4 and 8 are)")
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"{where}: GPTQ checkpoint_format {fmt!r} is not implemented (gptq, gptq_v2)")
    if config.get("dynamic"):
        raise ConfigError(f"{where}: GPTQ's per-module `dynamic` overrides are not implemented")
    _int(config, "group_size", 128, where)  # each module's scales say it again
    return QuantScheme("gptq", bits, fmt == "gptq", "")


def _ct_weights(name: str, group: dict, where: str) -> None:
    weights = group.get("weights") or {}
    kind, bits, strategy = weights.get("type", "int"), weights.get("num_bits"), weights.get("strategy")
    if kind == "float":
        if bits != 8 or strategy not in ("tensor", "channel"):
            raise ConfigError(f"{where}: compressed-tensors group {name!r}: float weights of {bits} bits by "
                              f"{strategy} are not implemented (fp8 by tensor or channel is)")
        return
    if kind != "int" or bits not in (4, 8) or strategy not in ("group", "channel"):
        raise ConfigError(f"{where}: compressed-tensors group {name!r}: {kind} weights of {bits} bits by "
                          f"{strategy} are not implemented (int4 and int8 by group or channel are)")
    if weights.get("actorder") == "group":
        raise ConfigError(f"{where}: compressed-tensors group {name!r}: actorder 'group' (a g_idx per module) "
                          "is not implemented")


def _ct_activations(name: str, group: dict, where: str) -> str:
    acts = group.get("input_activations")
    if not acts:
        return ""
    kind, bits, dynamic = acts.get("type", "int"), acts.get("num_bits"), acts.get("dynamic")
    if bits != 8 or not dynamic or acts.get("strategy") not in ("token", "tensor"):
        raise ConfigError(f"{where}: compressed-tensors group {name!r}: {'static' if not dynamic else 'dynamic'} "
                          f"{kind}{bits} activations by {acts.get('strategy')} are not implemented (dynamic 8-bit "
                          "per token or tensor is: computed here in the model's float dtype)")
    return (f"{kind}{bits} per {acts.get('strategy')}, dynamic: activations are computed in the model's float "
            "dtype (weight-only; the weights are the file's exactly)")


def _compressed_tensors(config: dict, where: str) -> QuantScheme:
    fmt = config.get("format")
    if fmt not in CT_FORMATS and fmt != "mixed-precision":
        raise ConfigError(f"{where}: compressed-tensors format {fmt!r} is not implemented ({', '.join(CT_FORMATS)})")
    for key in _CT_REFUSED:
        if config.get(key):
            raise ConfigError(f"{where}: compressed-tensors {key} is not implemented")
    groups = config.get("config_groups") or {}
    if not groups:
        raise ConfigError(f"{where}: compressed-tensors config names no config_groups")
    activations = set()
    for name, group in groups.items():
        if group.get("format") not in (None, *CT_FORMATS):
            raise ConfigError(f"{where}: compressed-tensors group {name!r}: format {group.get('format')!r} is not "
                              f"implemented ({', '.join(CT_FORMATS)})")
        if group.get("output_activations"):
            raise ConfigError(f"{where}: compressed-tensors group {name!r}: output activation quantization is "
                              "not implemented")
        _ct_weights(name, group, where)
        activations.add(_ct_activations(name, group, where))
    return QuantScheme("compressed-tensors", 0, False, "; ".join(sorted(a for a in activations if a)))


def scheme_of(raw: dict, where: str) -> QuantScheme | None:
    """config.json's quantization_config as a QuantScheme (None: not quantized); ConfigError where it
    names what is not implemented."""
    config = raw.get("quantization_config") or raw.get("compression_config")
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method == "awq":
        return _awq(config, where)
    if method == "gptq":
        return _gptq(config, where)
    if method == "compressed-tensors":
        return _compressed_tensors(config, where)
    raise ConfigError(f"{where}: quantization_config's quant_method {method or None!r} is not implemented "
                      f"({', '.join(CHECKPOINT_QUANTIZATIONS)} are)")
