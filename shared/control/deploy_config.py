"""The seed product's configuration objects, as wire types, each field checked against its range.

`FrameworkConfig` and `Acceleration` come with an upload; `ContinuousBatchingConfig` and
`OpenaiConfig` with `configure`; `DeploymentConfig` with `deploy`. The SDK (`switchyard.config`)
builds them and the API validates them again, so a value out of range is refused with a message
that names the field, the value and what is allowed, whoever sent it.
"""

from __future__ import annotations

import re

import msgspec

from shared.checks import MAX_CONTEXT, ConfigError, in_range, is_bool, one_of
from shared.config import CHECKPOINT_QUANTIZATIONS, DEFAULTS, DEPLOYMENT_MAX_NUM_SEQS, check_engine_field
from shared.speculative import parse_speculative_config

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # a DNS label: also a NATS subject token
ACCELS = ("cpu", "cuda", "qaic")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # the cuda backend's


def check_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ConfigError(f"{kind} name {name!r} is not allowed: use 1-63 lowercase letters, digits "
                          "and '-', starting and ending with a letter or digit")
    return name


LABEL_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?:[A-Za-z0-9._-]{0,63}$")


def check_label(field: str, label: object) -> str:
    """A node label as the product writes it, "key:value" (Kubernetes' key and value characters)."""
    if not isinstance(label, str) or not LABEL_RE.match(label):
        raise ConfigError(f"{field} = {label!r} is not a label: use key:value, such as 'kubernetes.io/os:linux'")
    return label


def workspace_id(value) -> int | None:
    """The product's docs type it as a string ("6"); its SDK sends an integer. Both mean workspace 6."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value)
    raise ConfigError(f"workspace_id = {value!r} is not allowed: a workspace number, such as 6 or \"6\"")


def visibility(value) -> str:
    one_of("visibility", value, ("private", "public"))
    return value


class FrameworkConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's engine arguments, as the seed product's FrameworkConfig carries them."""

    max_num_seqs: int = DEPLOYMENT_MAX_NUM_SEQS
    max_model_len: int | None = None  # None: the model's own context length
    max_seq_len_to_capture: int = DEFAULTS.max_seq_len_to_capture
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = DEFAULTS.gpu_memory_utilization
    block_size: int | None = None  # None: the engine's (16)
    device_group: str | None = None
    # GiB of the host's shared memory for the host KV tier its replicas there share (docs/kv_offloading.md);
    # outside the deployment's `memory`, which counts each replica's own
    kv_offloading_size: float = 0.0

    def validate(self, accel: str) -> FrameworkConfig:
        p = "framework_config."
        for name in ("max_num_seqs", "max_model_len", "max_seq_len_to_capture", "gpu_memory_utilization",
                     "kv_cache_dtype", "kv_offloading_size"):
            check_engine_field(name, getattr(self, name), p)
        if self.kv_offloading_size and accel == "qaic":
            raise ConfigError(f"{p}kv_offloading_size: the host KV tier keeps paged blocks; accel 'qaic' keeps whole "
                              "sequences in static-shape slots")
        if self.block_size is not None:
            check_engine_field("block_size", self.block_size, p)
        if self.kv_cache_dtype in FP8_KV_CACHE_DTYPES and accel != "cuda":
            raise ConfigError(f"{p}kv_cache_dtype = {self.kv_cache_dtype!r} is not supported by the torch backend: "
                              f"fp8 KV caches run on accel 'cuda' only")
        if self.kv_cache_dtype == "mxint8" and accel != "qaic":
            raise ConfigError(f"{p}kv_cache_dtype = 'mxint8' runs on accel 'qaic' only, not on {accel!r}")
        quant = self.quantization or "none"
        check_engine_field("quantization", quant, p)
        if accel == "qaic" and quant not in ("none", "auto", "mxfp6"):
            raise ConfigError(f"{p}quantization = {quant!r} is not allowed on accel 'qaic': allowed 'mxfp6' or none")
        if accel != "qaic" and quant == "mxfp6":
            raise ConfigError(f"{p}quantization = 'mxfp6' runs on accel 'qaic' only, not on {accel!r}")
        if quant not in ("none", "auto", "mxfp6", *CHECKPOINT_QUANTIZATIONS) and accel != "cpu":
            raise ConfigError(f"{p}quantization = {quant!r} runs on torch's CPU kernels only, not on {accel!r}")
        if self.device_group is not None:
            check_name(p + "device_group", self.device_group)
        return self

    @property
    def effective_block_size(self) -> int:
        return self.block_size or DEFAULTS.block_size


class QaicConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Qualcomm Cloud AI 100: programs compiled for fixed shapes (validated here; run by the QAIC backend)."""

    num_cores: int = 16
    num_devices: int = 1
    ctx_len: int = 128
    prefill_seq_len: int = 32
    full_batch_size: int | None = None
    mxfp6_matmul: bool = False
    mxint8_kv_cache: bool = False
    aic_enable_depth_first: bool = False

    def validate(self) -> QaicConfig:
        p = "accel.qaic."
        in_range(p + "num_cores", self.num_cores, 1, 16)
        in_range(p + "num_devices", self.num_devices, 1, 16)
        in_range(p + "ctx_len", self.ctx_len, 1, MAX_CONTEXT)
        in_range(p + "prefill_seq_len", self.prefill_seq_len, 1, self.ctx_len)
        in_range(p + "full_batch_size", self.full_batch_size, 1, 1024, allow_none=True)
        for flag in ("mxfp6_matmul", "mxint8_kv_cache", "aic_enable_depth_first"):
            is_bool(p + flag, getattr(self, flag))
        return self


class Accel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kind: str = "cpu"
    qaic: QaicConfig | None = None

    def validate(self) -> Accel:
        one_of("accel", self.kind, ACCELS)
        if self.qaic is not None and self.kind != "qaic":
            raise ConfigError(f"accel = {self.kind!r} takes no QaicConfig")
        if self.kind == "qaic":
            self.qaic = (self.qaic or QaicConfig()).validate()
        return self


def parse_accel(value) -> Accel:
    """The wire form of `accel`: "cpu" | "cuda" | "qaic" | {"qaic": {...QaicConfig}}."""
    if isinstance(value, str):
        return Accel(kind=value).validate()
    if isinstance(value, dict) and list(value) == ["qaic"]:
        return Accel(kind="qaic", qaic=convert(value["qaic"] or {}, QaicConfig, "accel.qaic")).validate()
    raise ConfigError(f"accel = {value!r} is not allowed: allowed 'cpu', 'cuda', 'qaic' or {{'qaic': {{...}}}}")


def check_qaic_framework(framework: FrameworkConfig, qaic: QaicConfig) -> None:
    """The framework config's vLLM names for what the QaicConfig compiles must agree with it."""
    p = "framework_config."
    if framework.quantization == "mxfp6" and not qaic.mxfp6_matmul:
        raise ConfigError(f"{p}quantization = 'mxfp6' needs accel.qaic.mxfp6_matmul = True (the program's weights)")
    if framework.kv_cache_dtype == "mxint8" and not qaic.mxint8_kv_cache:
        raise ConfigError(f"{p}kv_cache_dtype = 'mxint8' needs accel.qaic.mxint8_kv_cache = True (the program's KV cache)")
    if framework.block_size is not None:
        raise ConfigError(f"{p}block_size = {framework.block_size} is not allowed on accel 'qaic': a QAIC program "
                          "keeps each sequence's KV in one slot of ctx_len tokens, with no blocks")
    if framework.max_model_len is not None and framework.max_model_len > qaic.ctx_len:
        raise ConfigError(f"{p}max_model_len = {framework.max_model_len} is longer than accel.qaic.ctx_len = "
                          f"{qaic.ctx_len}: a QAIC program holds at most ctx_len tokens a sequence")


class ContinuousBatchingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_concurrent_batch_size: int = DEFAULTS.max_concurrent_batch_size
    # speculative decoding, as vLLM's --speculative-config (shared/speculative.py); None: off
    speculative_config: dict | None = None

    def validate(self) -> ContinuousBatchingConfig:
        check_engine_field("max_concurrent_batch_size", self.max_concurrent_batch_size, "continuous_batching_config.")
        try:
            parse_speculative_config(self.speculative_config)
        except ConfigError as exc:
            raise ConfigError(f"continuous_batching_config.{exc}") from None
        return self


class OpenaiConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Per-model OpenAI defaults; the API checks every key against its request models."""

    enabled: bool = True
    completion_config: dict = {}
    chat_completion_config: dict = {}


class SidekickResources(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one worker process (the seed product's "sidekick") of a model may use."""

    cpus: float = 1.0
    memory: str = "4Gi"
    gpus: int = 0


class DeploymentConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    replicas_min: int = 1
    replicas_max: int = 1
    cpus: float = 0.25  # the engine: the deployment's scheduler queue
    memory: str = "512Mi"
    sidekicks: dict[str, SidekickResources] = {}  # by model name
    deployment_label: str | None = None  # "key:value": only hosts (agents) with that label run it
    deterministic: bool | None = None  # batch-invariant float32 workers; None: the stack's --deterministic

    def validate(self) -> DeploymentConfig:
        in_range("deployment_config.replicas_min", self.replicas_min, 1, 16)
        in_range("deployment_config.replicas_max", self.replicas_max, self.replicas_min, 16)
        in_range("deployment_config.cpus", self.cpus, 0.1, 256)
        parse_memory("deployment_config.memory", self.memory)
        for model, side in self.sidekicks.items():
            p = f"deployment_config.sidekick[{model}]."
            in_range(p + "cpus", side.cpus, 0.5, 256)
            in_range(p + "gpus", side.gpus, 0, 16)
            parse_memory(p + "memory", side.memory)
        if self.deployment_label is not None:
            check_label("deployment_config.deployment_label", self.deployment_label)
        if self.deterministic is not None:
            is_bool("deployment_config.deterministic", self.deterministic)
        return self

    def sidekick(self, model: str) -> SidekickResources:
        return self.sidekicks.get(model, SidekickResources())


_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_memory(field: str, value: str) -> int:
    """Kubernetes quantities, as the seed product takes them: "512Mi", "4Gi", "1G", "1048576"."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|K|M|G|T)?", str(value).strip())
    if not m:
        raise ConfigError(f"{field} = {value!r} is not a memory quantity such as '512Mi' or '4Gi'")
    size = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if not (2**20 <= size <= 2**44):
        raise ConfigError(f"{field} = {value!r} is out of range: allowed 1Mi to 16Ti")
    return size


def convert(raw, cls, field: str):
    """Wire dict -> typed config, with msgspec's type errors reworded to name the field."""
    try:
        return msgspec.convert(raw, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{field}: {exc}") from None
