"""Typed engine configuration, validated at the edge with messages a user understands.

Every service that needs a value takes it from the same flags (or SY_* environment variables),
so the launcher passes one set of flags to all of them.
"""

from __future__ import annotations

import argparse
import os

import msgspec

from shared.checks import MAX_CONTEXT, ConfigError, in_range, one_of
from shared.kv_transfer import KvTransferConfig, parse_kv_transfer_config
from shared.models.hub import is_hub_id
from shared.speculative import SpeculativeConfig, parse_speculative_config
from shared.wire.lora import add_lora_args

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# fp8: the cuda backend only; mxint8: the qaic backend only
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "mxint8")
# on the CPU: weight-only int8 / int4, or int8 activations too; mxfp6: the qaic backend only; auto: the
# model file's own (shared/engine_defaults.py); awq, gptq, compressed-tensors: a checkpoint's own, as
# vLLM names them (a checkpoint of another kind is refused)
CHECKPOINT_QUANTIZATIONS = ("awq", "gptq", "compressed-tensors")
FILES_OWN = ("gguf", *CHECKPOINT_QUANTIZATIONS)  # a file's own blocks or integers, kept (gguf: auto's pick, never asked)
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w8a8", "mxfp6", *CHECKPOINT_QUANTIZATIONS)
KV_CACHE_DTYPES_REFUSED = ("fp8_e5m2", "int8")  # known, but no backend here has them
QUANTIZATIONS_REFUSED = ("fp8", "bitsandbytes", "gguf")
BLOCK_SIZES = (8, 16, 32, 64, 128)
QUANT_ACTIVATIONS = ("float32", "int8")  # the cpu backend's rows into quant_linear (kernels/csrc/quant_dot.c)
COMPILE_NICE = 19  # the background compile's niceness: the lowest priority, so serving preempts it
LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str = DEFAULT_MODEL_NAME  # served name; also the subject token
    model_path: str | None = None  # GGUF file, HF directory or Hub id (shared/models/hub.py); None = the default model
    revision: str | None = None  # a Hub id's branch, tag or commit (default: main)
    download_dir: str | None = None  # where a Hub id is downloaded (default: huggingface_hub's cache, HF_HOME)
    load_format: str = "auto"  # auto | gguf | hf | dummy
    max_model_len: int | None = None  # None = the model's own context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_gib: float = 1.0  # CPU memory budget for the paged KV pool
    num_kv_blocks: int | None = None  # overrides the budget (tests use it to force preemption)
    enable_prefix_caching: bool = True
    kv_offloading_size: float = 0.0  # GiB of the host KV tier's shared memory (0: none; docs/kv_offloading.md)
    kv_offloading_dir: str | None = None  # where the host tier's file lives (None: /dev/shm); one per host
    kv_offloading_disk_size: float = 0.0  # GiB of a local disk the tier's LRU spills to (0: none)
    kv_offloading_disk_dir: str | None = None  # that disk's folder (None: /var/tmp)
    max_waiting: int = 1024  # queue bound per model; beyond it Submit is rejected (429)
    max_concurrent_batch_size: int = 256  # requests running at once per model, across its workers
    batching: str = "continuous"  # or "static": a batch runs to completion first (for comparison)
    num_scheduler_steps: int = 0  # decode iterations per Step when nothing waits (multi-step); 0: the worker's pick
    long_prefill_token_threshold: int = 0  # a prompt's tokens per step while prompts compete (0: budget / 4)
    quantization: str = "auto"  # the GGUF's own, or "none" / "int8" / "int4" (weight-only) / "w8a8" (torch_cpu/quantization.py)
    step_timeout_s: float = 60.0
    max_migrations: int = 2  # a request on a worker that dies is recomputed on another this many times at most
    worker_grace_s: float = 60.0  # a request whose worker is gone waits this long for one of the model's to take it
    drain_grace_s: float = 30.0  # on SIGTERM: how long in-flight requests may take to finish
    # the worker's backend (flags in add_worker_args; a deployment's FrameworkConfig carries its own)
    gpu_memory_utilization: float = 0.9  # cuda: the share of the GPU's memory the worker takes
    max_seq_len_to_capture: int = 8192  # cuda: decode steps with longer contexts run without CUDA graphs
    speculative_config: SpeculativeConfig | None = None  # vLLM's JSON (shared/speculative.py); None: off
    kv_transfer_config: KvTransferConfig | None = None  # disaggregated prefill (shared/kv_transfer.py); None: off

    def validate(self) -> EngineConfig:
        for name in ENGINE_CHECKS:
            check_engine_field(name, getattr(self, name))
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError(f"max_num_batched_tokens = {self.max_num_batched_tokens} is out of range: "
                              f"allowed block_size ({self.block_size}) or more")
        if self.speculative_config is not None:
            self.speculative_config = self.speculative_config.validate()
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = self.kv_transfer_config.validate()
            if not self.kv_offloading_size:
                raise ConfigError("--kv-transfer-config: the SharedMemoryConnector hands a prefill worker's blocks to a "
                                  "decode worker through the host KV tier; give it --kv-offloading-size GIB")
        if self.kv_offloading_disk_size and not self.kv_offloading_size:
            raise ConfigError("--kv-offloading-disk-size: the disk takes what the host KV tier drops; give the tier "
                              "--kv-offloading-size GIB too")
        return self


# each engine field's one check, whoever sets it: a flag or SY_* variable (EngineConfig above) or a
# deployment's upload (shared/control/deploy_config.py's FrameworkConfig, with its accelerator's rules on top)
ENGINE_CHECKS = {
    "block_size": lambda f, v: one_of(f, v, BLOCK_SIZES),
    "max_model_len": lambda f, v: in_range(f, v, 2, MAX_CONTEXT, allow_none=True),
    "max_num_seqs": lambda f, v: in_range(f, v, 1, 1024),
    "max_num_batched_tokens": lambda f, v: in_range(f, v, 1),
    "long_prefill_token_threshold": lambda f, v: in_range(f, v, 0),
    "max_migrations": lambda f, v: in_range(f, v, 0),
    "worker_grace_s": lambda f, v: in_range(f, v, 0),
    "drain_grace_s": lambda f, v: in_range(f, v, 0),
    "max_waiting": lambda f, v: in_range(f, v, 0),
    "max_concurrent_batch_size": lambda f, v: in_range(f, v, 1, 100_000),
    "num_scheduler_steps": lambda f, v: in_range(f, v, 0, 64),  # 0: the worker's pick
    "num_kv_blocks": lambda f, v: in_range(f, v, 2, allow_none=True),
    "kv_offloading_size": lambda f, v: in_range(f, v, 0),
    "kv_offloading_disk_size": lambda f, v: in_range(f, v, 0),
    "kv_cache_dtype": lambda f, v: one_of(f, v, KV_CACHE_DTYPES, KV_CACHE_DTYPES_REFUSED, "by any backend here"),
    "quantization": lambda f, v: one_of(f, v, QUANTIZATIONS, QUANTIZATIONS_REFUSED, "by the torch backend"),
    "load_format": lambda f, v: one_of(f, v, LOAD_FORMATS),
    "batching": lambda f, v: one_of(f, v, ("continuous", "static")),
    "gpu_memory_utilization": lambda f, v: in_range(f, v, 0.05, 1.0),
    "max_seq_len_to_capture": lambda f, v: in_range(f, v, 1, MAX_CONTEXT),
}


def check_engine_field(name: str, value, prefix: str = "") -> None:
    """Raises ConfigError naming `prefix + name` when `value` is not allowed for that engine field."""
    ENGINE_CHECKS[name](prefix + name, value)


DEFAULTS = EngineConfig()  # the one owner of every engine default; other structs read theirs from it
# a deployment's FrameworkConfig.max_num_seqs when it names none: vLLM's EngineArgs default, as the
# seed product's FrameworkConfig documents it (make run's 64 above is sized for a CPU)
DEPLOYMENT_MAX_NUM_SEQS = 256


def env_default(name: str, default):
    """A flag's default from the environment (SY_<NAME>), as a string argparse converts with the
    flag's type, or `default` when unset."""
    return os.environ.get(f"SY_{name.upper()}", default)


def env_flag(name: str, default: bool | None) -> bool | None:
    """A boolean flag's default from SY_<NAME>: 1/true/yes/on or 0/false/no/off, any case; unset or
    empty: `default`."""
    raw = os.environ.get(f"SY_{name.upper()}", "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"SY_{name.upper()}={raw!r}: expected 1/true/yes/on or 0/false/no/off")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    parser.add_argument("--model", default=env_default("model", None),
                        help=f"served model name (default: a Hub id as given, else {d.model})")
    parser.add_argument("--model-path", default=env_default("model_path", d.model_path),
                        help="a GGUF file, a Hugging Face model directory, or a Hub id: org/name (a transformers "
                             "checkpoint) or org/name:TAG (one GGUF of the repo, e.g. :Q4_K_M), fetched through "
                             "huggingface_hub (HF_ENDPOINT, HF_TOKEN, HF_HOME, HF_HUB_OFFLINE); default: SmolLM2")
    parser.add_argument("--revision", default=env_default("revision", d.revision),
                        help="a Hub id's branch, tag or commit (default: main)")
    parser.add_argument("--download-dir", default=env_default("download_dir", d.download_dir),
                        help="the cache a Hub id is downloaded to (default: huggingface_hub's, under HF_HOME)")
    parser.add_argument("--load-format", default=env_default("load_format", d.load_format))
    parser.add_argument("--max-model-len", type=int, default=env_default("max_model_len", d.max_model_len))
    parser.add_argument("--max-num-seqs", type=int, default=env_default("max_num_seqs", d.max_num_seqs))
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=env_default("max_num_batched_tokens", d.max_num_batched_tokens)
    )
    parser.add_argument("--block-size", type=int, default=env_default("block_size", d.block_size))
    parser.add_argument("--kv-cache-dtype", default=env_default("kv_cache_dtype", d.kv_cache_dtype))
    parser.add_argument(
        "--kv-cache-memory-gib", type=float, default=env_default("kv_cache_memory_gib", d.kv_cache_memory_gib)
    )
    parser.add_argument("--num-kv-blocks", type=int, default=env_default("num_kv_blocks", d.num_kv_blocks))
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=env_flag("enable_prefix_caching", True))
    parser.add_argument("--kv-offloading-size", type=float, default=env_default("kv_offloading_size", d.kv_offloading_size),
                        help="GiB of host shared memory keeping the KV blocks the host's workers compute (0: off)")
    parser.add_argument("--kv-offloading-dir", default=env_default("kv_offloading_dir", d.kv_offloading_dir),
                        help="the host KV tier's folder (default /dev/shm); workers sharing one share the tier")
    parser.add_argument("--kv-offloading-disk-size", type=float,
                        default=env_default("kv_offloading_disk_size", d.kv_offloading_disk_size),
                        help="GiB of a local disk the host KV tier's least recently used blocks spill to (0: off)")
    parser.add_argument("--kv-offloading-disk-dir", default=env_default("kv_offloading_disk_dir", d.kv_offloading_disk_dir),
                        help="the disk spill's folder (default /var/tmp)")
    parser.add_argument("--kv-transfer-config", default=env_default("kv_transfer_config", None),
                        help="disaggregated prefill, vLLM's JSON: kv_connector SharedMemoryConnector, kv_role "
                             "kv_producer, kv_consumer or kv_both (docs/kv_offloading.md)")
    parser.add_argument("--max-waiting", type=int, default=env_default("max_waiting", d.max_waiting))
    parser.add_argument("--max-concurrent-batch-size", type=int,
                        default=env_default("max_concurrent_batch_size", d.max_concurrent_batch_size))
    parser.add_argument("--quantization", default=env_default("quantization", d.quantization),
                        help="auto (default): the GGUF's own Q4_0/Q4_1/Q8_0 blocks kept; none: dense; int8 or int4: "
                             "weight-only; w8a8: int8 weights and activations (docs/configuration.md)")
    parser.add_argument("--batching", default=env_default("batching", d.batching),
                        help="continuous (iteration-level) or static (a batch runs to completion; for comparison)")
    parser.add_argument("--num-scheduler-steps", type=int, default=env_default("num_scheduler_steps", d.num_scheduler_steps),
                        help="decode iterations a worker runs per Step while no request waits (1: one per Step; "
                             "0, the default: the worker's pick, 4 when its decode steps are compiled)")
    parser.add_argument("--long-prefill-token-threshold", type=int,
                        default=env_default("long_prefill_token_threshold", d.long_prefill_token_threshold),
                        help="while several prompts are being computed, each takes at most this many tokens a "
                             "step, so short ones get a first token beside a long one (0: a quarter of the budget)")
    parser.add_argument("--engine-cpus", type=float, default=float(env_default("engine_cpus", os.cpu_count() or 1)),
                        help="CPUs the deployments' engines (deployment_config.cpus) may reserve in the scheduler")
    parser.add_argument("--engine-memory", default=env_default("engine_memory", f"{_physical_memory_mib() // 4}Mi"),
                        help="memory the deployments' engines (deployment_config.memory) may reserve in the scheduler")
    parser.add_argument("--step-timeout-s", type=float, default=env_default("step_timeout_s", d.step_timeout_s))
    parser.add_argument("--max-migrations", type=int, default=env_default("max_migrations", d.max_migrations),
                        help="times a request on a worker that dies is recomputed on another (0: it fails instead)")
    parser.add_argument("--worker-grace-s", type=float, default=env_default("worker_grace_s", d.worker_grace_s),
                        help="how long the requests of a worker that is gone wait for another of the model's workers "
                             "(or the same one back) when none can take them at once; then they end with a "
                             "retryable error (default 60)")
    parser.add_argument("--drain-grace-s", type=float, default=env_default("drain_grace_s", d.drain_grace_s))
    parser.add_argument("--speculative-config", default=env_default("speculative_config", None),
                        help="speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                             "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} (docs/speculative_decoding.md)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = {f: getattr(args, f) for f in EngineConfig.__struct_fields__ if hasattr(args, f)}
    if "speculative_config" in fields:
        fields["speculative_config"] = parse_speculative_config(fields["speculative_config"])
    if "kv_transfer_config" in fields:
        fields["kv_transfer_config"] = parse_kv_transfer_config(fields["kv_transfer_config"])
    if fields.get("model") is None:  # as vLLM's: a Hub id serves under its own name
        fields["model"] = fields.get("model_path") if is_hub_id(fields.get("model_path")) else DEFAULTS.model
    typed = msgspec.convert(fields, EngineConfig, strict=False)
    return typed.validate()


WORKER_DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_AUTO_DTYPE = "float32"  # what --dtype auto is on every CPU (shared/engine_defaults.py says why)
WORKER_DEVICES = ("cpu", "cuda", "qaic")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    parser.add_argument("--worker-id", default=env_default("worker_id", None))
    parser.add_argument("--device", default=env_default("device", "cpu"), choices=WORKER_DEVICES,
                        help="the worker's backend: cpu (torch, the reference), cuda (Triton kernels, CUDA graphs) "
                             "or qaic (Cloud AI 100's static-shape program; emulated without the cards)")
    parser.add_argument("--qaic-config", default=env_default("qaic_config", "{}"),
                        help="qaic: the QaicConfig as JSON, e.g. '{\"full_batch_size\": 8, \"ctx_len\": 256}'")
    parser.add_argument("--dtype", default=env_default("dtype", "auto"), choices=WORKER_DTYPES,
                        help=f"the weights' dtype; auto: {CPU_AUTO_DTYPE} on the cpu backend, on every CPU (the "
                             "worker and the launcher print why), bfloat16 on cuda")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=float(env_default("gpu_memory_utilization", d.gpu_memory_utilization)),
                        help="cuda: the share of the GPU's memory the worker takes (weights, activations, KV pool)")
    parser.add_argument("--max-seq-len-to-capture", type=int,
                        default=int(env_default("max_seq_len_to_capture", d.max_seq_len_to_capture)),
                        help="cuda: decode steps whose longest context exceeds this run without CUDA graphs")
    parser.add_argument("--threads", type=int, default=env_default("threads", "0"),
                        help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--pipeline", default=None,
                        help="serve this deployed pipeline (its configs come from the registry); set by the agent")
    parser.add_argument("--generation", type=int, default=0, help="the pipeline's deployment generation")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        default=env_flag("compile", None),
                        help="compile the decode step's layers with torch.compile (Inductor), in the background "
                             "while the worker serves eagerly (cached on disk); default: on unless the model "
                             "computes in dense float32 or --deterministic")
    parser.add_argument("--compile-nice", type=int, default=env_default("compile_nice", COMPILE_NICE),
                        help=f"niceness of --compile's background compile (default {COMPILE_NICE}: serving preempts "
                             "it); 0 lets it finish on a host busy with other work")
    parser.add_argument("--quant-activations", choices=QUANT_ACTIVATIONS,
                        default=env_default("quant_activations", QUANT_ACTIVATIONS[0]),
                        help="cpu: what the 4-, 5- and 6-bit weights (a GGUF's k-quants, Q4_0/Q4_1, int4 "
                             "checkpoints) multiply: float32 rows (exact to the weights), or int8 (per 256 inputs for "
                             "a k-quant, else 32) as llama.cpp quantizes them (faster; docs/configuration.md)")
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction,
                        default=env_flag("deterministic", False),
                        help="batch-invariant float32: a request's tokens do not depend on what else is in its "
                             "batch (dense weights, no compile); slower")
    add_lora_args(parser)
    parser.add_argument("--nice", type=int, default=env_default("nice", "0"),
                        help="scheduling niceness of the worker (default 0). 10 lets the gateway, scheduler and bus "
                             "preempt the model's threads on shared cores, but any busy neighbour then starves the "
                             "model (9-10x slower beside two busy processes on 2 cores; docs/benchmarks.md)")


def _physical_memory_mib() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20


def _accels(value: str) -> str:
    kinds = value.split(",")
    if value != "auto" and not all(k in ("cpu", "cuda", "qaic") for k in kinds):
        raise argparse.ArgumentTypeError(f"{value!r}: give auto, or kinds of cpu, cuda and qaic joined by ','")
    return value


def add_agent_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--accel", default=env_default("accel", "auto"), type=_accels,
                        help="the accelerators this host's workers run on, e.g. cpu or cpu,qaic; auto: cpu, cuda "
                             "when an NVIDIA GPU is present, and qaic (emulated on a host without Cloud AI 100 cards)")
    parser.add_argument("--label", action="append", dest="labels", metavar="KEY:VALUE",
                        default=[label for label in env_default("agent_labels", "").split(",") if label],
                        help="a node label (repeatable) that deployment_config.deployment_label is matched against, "
                             "besides kubernetes.io/os, kubernetes.io/arch and kubernetes.io/hostname")
    parser.add_argument("--qaic-socs", type=int, default=int(env_default("qaic_socs", "8")),
                        help="Cloud AI 100 SoCs this host offers (emulated without the cards); a QAIC replica "
                             "takes its sidekick_gpus of them")
    parser.add_argument("--agent-id", default=env_default("agent_id", None))
    parser.add_argument("--device-group", default=env_default("device_group", None),
                        help="only deployments whose framework_config.device_group names it run here")
    parser.add_argument("--agent-cpus", type=float, default=float(env_default("agent_cpus", os.cpu_count() or 1)),
                        help="CPUs the deployments on this host may reserve in all")
    parser.add_argument("--agent-memory", default=env_default("agent_memory", f"{_physical_memory_mib() * 9 // 10}Mi"),
                        help="memory the deployments on this host may reserve in all (default: 90%% of RAM)")
    parser.add_argument("--agent-log-dir", default=env_default("agent_log_dir", None))
    parser.add_argument("--scale-up-after-s", type=float, default=float(env_default("scale_up_after_s", "5")),
                        help="add a replica (up to replicas_max) when requests have waited this long")
    parser.add_argument("--scale-down-after-s", type=float, default=float(env_default("scale_down_after_s", "30")),
                        help="remove a replica (down to replicas_min) when the engine has been idle this long")


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--leader-lease", default=env_default("leader_lease", None) or None,
                        help="leadership among scheduler processes by a JetStream KV lease of this name: one "
                             "leads, the others wait as standbys and take over its requests when it is gone "
                             "(docs/architecture.md); default: none, this scheduler serves at once")


def add_nats_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))


def resolve_max_model_len(configured: int | None, model_max: int) -> int:
    """The context limit every service applies: the configured one, never past the model's."""
    if configured is None:
        return model_max
    if configured > model_max:
        raise ConfigError(f"max_model_len {configured} exceeds the model's context length {model_max}")
    return configured


def context_length_error(max_model_len: int, num_prompt_tokens: int, max_tokens: int) -> str | None:
    """The one message for a request that does not fit, naming both numbers (API and scheduler)."""
    total = num_prompt_tokens + max_tokens
    if total <= max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or of max_tokens.")
