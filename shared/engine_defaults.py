"""The CPU engine's settings left on auto, picked from the CPU's features and the model file, each with its reason.

The worker applies them and logs them; the launcher prints them at start-up (the same function).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from shared.config import ConfigError
from shared.cpu_features import host_cpu_flags
from shared.gguf_fields import is_gguf, read_fields

# the GGUF block formats the CPU backend keeps as they are (loader/gguf_blocks.py)
KEPT_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bfloat16 GEMMs in hardware; without them torch converts
MULTI_STEP = 4  # decode iterations per Step when the steps are short (compiled)


@dataclass(frozen=True)
class Choice:
    value: object
    reason: str


@dataclass(frozen=True)
class EngineDefaults:
    deterministic: Choice
    dtype: Choice
    quantization: Choice
    compile: Choice
    num_scheduler_steps: Choice

    def lines(self) -> list[str]:
        """One line a setting, as the launcher prints them: `compile on: <reason>`."""
        names = ("dtype", "quantization", "compile", "num_scheduler_steps", "deterministic")
        shown = {True: "on", False: "off"}
        return [f"{n} {shown.get(getattr(self, n).value, getattr(self, n).value)}: {getattr(self, n).reason}"
                for n in names]

    def as_log(self) -> dict:
        return {name: getattr(self, name).value for name in self.__dataclass_fields__} | {
            f"{name}_reason": getattr(self, name).reason for name in self.__dataclass_fields__}


def pick(flags: set[str], gguf_types: dict[str, int], *, dtype: str = "auto", quantization: str = "auto",
         compile: bool | None = None, num_scheduler_steps: int = 0, deterministic: bool = False,
         has_compiler: bool | None = None) -> EngineDefaults:
    """`gguf_types`: the model file's tensor types and their counts ({} for a Hugging Face folder).
    A value given explicitly is kept; `deterministic` refuses one that would break it."""
    if deterministic:
        wrong = [f"--dtype {dtype}"] * (dtype not in ("auto", "float32")) + \
                [f"--quantization {quantization}"] * (quantization not in ("auto", "none")) + ["--compile"] * bool(compile)
        if wrong:
            raise ConfigError(f"--deterministic computes in float32 with dense weights, eagerly: {', '.join(wrong)} "
                              "would make a request's tokens depend on its batch; drop one or the other")
        return EngineDefaults(
            deterministic=Choice(True, "asked for: every request's tokens are the same whatever else is in the batch"),
            dtype=Choice("float32", "deterministic: float32 matmuls give the same result for a row at any batch size"),
            quantization=Choice("none", "deterministic: the file's weights dequantized once, exactly, to float32"),
            compile=Choice(False, "deterministic: compiled and eager kernels differ in the last bits"),
            num_scheduler_steps=_steps(num_scheduler_steps, False))
    picked_dtype = _dtype(dtype, flags)
    picked_quant = _quantization(quantization, gguf_types)
    picked_compile = _compile(compile, picked_dtype.value, picked_quant.value,
                              shutil.which("g++") is not None if has_compiler is None else has_compiler)
    return EngineDefaults(
        deterministic=Choice(False, "the fast path: a request's tokens may depend on its batch (--deterministic "
                                    "for batch-invariant float32)"),
        dtype=picked_dtype, quantization=picked_quant, compile=picked_compile,
        num_scheduler_steps=_steps(num_scheduler_steps, picked_compile.value))


def pick_for_host(args, config, model_path: str, deterministic: bool) -> EngineDefaults:
    """`pick` for this host's CPU and the model file at `model_path`, with the worker's flags
    (`args`: --dtype, --compile) and the engine's config (quantization, num_scheduler_steps)."""
    types = read_fields(model_path)["__tensor_types__"] if config.load_format != "dummy" and is_gguf(model_path) else {}
    return pick(host_cpu_flags(), types, dtype=args.dtype, quantization=config.quantization, compile=args.compile,
                num_scheduler_steps=config.num_scheduler_steps, deterministic=deterministic)


def _dtype(asked: str, flags: set[str]) -> Choice:
    if asked != "auto":
        return Choice(asked, "asked for")
    have = [f for f in BF16_FLAGS if f in flags]
    if have:
        return Choice("bfloat16", f"the CPU has {' and '.join(have)}: bfloat16 GEMMs in hardware, 2-3x float32's speed")
    return Choice("float32", "the CPU has no AVX-512 BF16 (nor AMX): torch would convert bfloat16, slower than float32")


def _quantization(asked: str, gguf_types: dict[str, int]) -> Choice:
    if asked != "auto":
        return Choice(asked, "asked for")
    kept = {t: n for t, n in gguf_types.items() if t in KEPT_GGUF_TYPES}
    if kept:
        what = ", ".join(f"{n} {t}" for t, n in sorted(kept.items()))
        return Choice("gguf", f"the GGUF's own blocks kept as they are ({what} tensors; Q8_0 at 8 bits) on "
                              "torch's int4 kernels; --quantization none computes with them dequantized")
    return Choice("none", "the model file holds no Q4_0, Q4_1 or Q8_0 tensors to keep")


def _compile(asked: bool | None, dtype: str, quantization: str, has_compiler: bool) -> Choice:
    if asked is not None:
        return Choice(asked, "asked for")
    if not has_compiler:
        return Choice(False, "no C++ compiler (g++) for torch.compile's Inductor")
    if dtype == "float32" and quantization == "none":
        return Choice(False, "float32 Linears run on oneDNN's packed weights, which a compiled graph cannot take")
    return Choice(True, "decode steps of up to 8 rows are bound by launching ops; compiled in the background "
                        "while the worker serves eagerly, and cached on disk for the next start")


def _steps(asked: int, compiled: bool) -> Choice:
    if asked:
        return Choice(asked, "asked for")
    if compiled:
        return Choice(MULTI_STEP, "compiled decode steps are short, so the scheduler's round trip between them "
                                  "is a large share: several iterations per Step while nothing waits")
    return Choice(1, "eager steps are long against the scheduler's round trip")
