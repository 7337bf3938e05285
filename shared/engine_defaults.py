"""The CPU engine's settings left on auto, picked from the model file and whether the worker's C
kernels are built, each with its reason.

The worker applies them and logs them; the launcher prints them at start-up (the same function).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.config import CHECKPOINT_QUANTIZATIONS, CPU_AUTO_DTYPE, ConfigError
from shared.models.gguf_fields import is_gguf, read_fields

# the GGUF block formats the CPU backend keeps as they are (loader/gguf_blocks.py, gguf_kquants.py)
KEPT_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
MULTI_STEP = 4  # decode iterations per Step when the steps are short (on the C kernels)
# the quantizations whose Linears are the C kernels' quant_linear
QUANT_LINEAR = ("gguf", "int4", "int8", *CHECKPOINT_QUANTIZATIONS)


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


def pick(gguf_types: dict[str, int], *, kernels: str | None, dtype: str = "auto", quantization: str = "auto",
         compile: bool | None = None, num_scheduler_steps: int = 0, deterministic: bool = False,
         checkpoint: str | None = None) -> EngineDefaults:
    """`gguf_types`: the model file's tensor types and their counts ({} for a Hugging Face folder);
    `checkpoint`: a Hugging Face folder's quantization_config.quant_method (None: not quantized);
    `kernels`: None where the worker's C kernels are built for this checkout, else why they are not.
    A value given explicitly is kept; `deterministic` refuses one that would break it."""
    if deterministic:
        wrong = [f"--dtype {dtype}"] * (dtype not in ("auto", "float32")) + \
                [f"--quantization {quantization}"] * (quantization not in ("auto", "none")) + ["--compile"] * bool(compile)
        if wrong:
            raise ConfigError(f"--deterministic computes in float32 with dense weights, eagerly: {', '.join(wrong)} "
                              "would make a request's tokens depend on its batch; drop one or the other")
        return EngineDefaults(
            deterministic=Choice(True, "asked for: torch's own ops, the reference the fast path is checked against"),
            dtype=Choice("float32", "deterministic: float32 matmuls give the same result for a row at any batch size"),
            quantization=Choice("none", "deterministic: the file's weights dequantized once, exactly, to float32"),
            compile=Choice(False, "deterministic: torch's eager ops"),
            num_scheduler_steps=_steps(num_scheduler_steps, False))
    picked_quant = _quantization(quantization, gguf_types, kernels, checkpoint)
    return EngineDefaults(
        deterministic=Choice(False, "the fast path: the C kernels, each row computed alone, so a request's tokens "
                                    "do not depend on its batch (docs/configuration.md says where they still may)"),
        dtype=_dtype(dtype), quantization=picked_quant, compile=_compile(compile, kernels),
        num_scheduler_steps=_steps(num_scheduler_steps, kernels is None and picked_quant.value in QUANT_LINEAR))


def pick_for_host(config, model_path: str, *, dtype: str, compile: bool | None, deterministic: bool,
                  kernels: str | None) -> EngineDefaults:
    """`pick` for the model file at `model_path`, with the worker's --dtype and --compile and the
    engine's config (quantization, num_scheduler_steps)."""
    return pick(gguf_types(model_path, config.load_format), kernels=kernels, dtype=dtype, quantization=config.quantization, compile=compile,
                num_scheduler_steps=config.num_scheduler_steps, deterministic=deterministic,
                checkpoint=None if config.load_format == "dummy" else checkpoint_quantization(model_path))


def _dtype(asked: str) -> Choice:
    if asked != "auto":
        return Choice(asked, "asked for")
    return Choice(CPU_AUTO_DTYPE, "every CPU: the fast path computes what --deterministic computes, its sums in "
                             "another order; bfloat16 rows changed 14 of 20 greedy answers (--dtype bfloat16)")


def gguf_types(model_path: str, load_format: str) -> dict[str, int]:
    """A GGUF's tensor types and their counts ({}: not a GGUF, or dummy weights)."""
    return read_fields(model_path)["__tensor_types__"] if load_format != "dummy" and is_gguf(model_path) else {}


def own_quantization(model_path: str, load_format: str) -> str | None:
    """What the file keeps quantized as it is, for a backend that computes with it: a checkpoint's own
    format (awq, gptq, compressed-tensors), or gguf where a GGUF holds tensors of the kept types."""
    if load_format == "dummy":
        return None
    own = checkpoint_quantization(model_path)
    if own in CHECKPOINT_QUANTIZATIONS:
        return own
    return "gguf" if any(t in KEPT_GGUF_TYPES for t in gguf_types(model_path, load_format)) else None


def checkpoint_quantization(model_path: str) -> str | None:
    """A Hugging Face folder's quantization_config.quant_method, lower case (None: none, or not a folder)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    raw = json.loads(config.read_text())
    quant = raw.get("quantization_config") or raw.get("compression_config") or {}
    return str(quant.get("quant_method", "")).lower() or None


def refuse_other_checkpoint(asked: str, checkpoint: str | None) -> None:
    """--quantization awq (gptq, compressed-tensors) names the checkpoint's format, as vLLM's does: it must be it."""
    if asked in CHECKPOINT_QUANTIZATIONS and asked != checkpoint:
        raise ConfigError(f"--quantization {asked} names the checkpoint's own format, and this checkpoint's "
                          f"quantization_config names {checkpoint or 'none'}: use --quantization auto")


def _quantization(asked: str, gguf_types: dict[str, int], kernels: str | None, checkpoint: str | None) -> Choice:
    refuse_other_checkpoint(asked, checkpoint)
    if checkpoint in CHECKPOINT_QUANTIZATIONS and asked in ("auto", checkpoint):
        if kernels is not None:
            return Choice("none", f"the {checkpoint} checkpoint's integers need the C kernels, and {kernels}: its "
                                  "weights dequantized")
        return Choice(checkpoint, f"the {checkpoint} checkpoint's own integers and scales kept as they are on the C "
                                  "kernels' quant_linear; --quantization none computes with them dequantized")
    if asked != "auto":
        return Choice(asked, "asked for")
    kept = {t: n for t, n in gguf_types.items() if t in KEPT_GGUF_TYPES}
    if not kept:
        return Choice("none", f"the model file holds no tensors of the types kept as they are ({', '.join(KEPT_GGUF_TYPES)})")
    if kernels is not None:
        return Choice("none", f"the file's blocks need the C kernels, and {kernels}: its weights dequantized")
    what = ", ".join(f"{n} {t}" for t, n in sorted(kept.items()))
    return Choice("gguf", f"the GGUF's own blocks kept as they are ({what} tensors) on the C kernels' "
                          "quant_linear; --quantization none computes with them dequantized")


def _compile(asked: bool | None, kernels: str | None) -> Choice:
    if asked is not None:
        return Choice(asked, "asked for")
    if kernels is not None:
        return Choice(False, f"a compiled step calls the C kernels, and {kernels}")
    return Choice(False, "the eager steps run the C kernels: compiling saves ~7% of a batch-1 step and nothing from "
                         "4 rows (docs/benchmarks.md), for a first start's compile of every core (--compile)")


def _steps(asked: int, short: bool) -> Choice:
    if asked:
        return Choice(asked, "asked for")
    if short:
        return Choice(MULTI_STEP, "decode steps on the C kernels are short (~10 ms at batch 1), so the scheduler's "
                                  "round trip between them is a large share: several iterations per Step while "
                                  "nothing waits")
    return Choice(1, "decode steps on dense weights are long against the scheduler's round trip")
