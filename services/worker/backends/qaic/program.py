"""The QAIC "compile": a model built into a program of fixed-shape specializations, with its weight
image in the device's formats, built once per (model, configuration) and cached.

QEfficient compiles a model into a QPC with two specializations (prefill: batch 1 over
`prefill_seq_len` tokens; decode: `full_batch_size` slots of one token, both over `ctx_len`) and
build options. Here the program is the same description, the MXFP6 weight image (when
`mxfp6_matmul`) in the cache, keyed by the artifact and its configuration, and the emulator
below runs exactly those shapes. `runtime.py` is where Qualcomm's runtime would take over.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.worker.backends.qaic.mx import MXFP6Tensor
from services.worker.backends.qaic.mx_linear import encode_weights
from shared.control.deploy_config import QaicConfig
from shared.models.model_files import cache_dir_for

FORMAT = "qaic-program-v1"


@dataclass(frozen=True)
class Specialization:
    name: str
    batch_size: int
    seq_len: int
    ctx_len: int


@dataclass
class QaicProgram:
    specializations: list[Specialization]
    build_options: dict  # what the compiler would be given (and is shown as such)
    weight_image: dict[str, MXFP6Tensor]  # empty without mxfp6_matmul
    compile_seconds: float
    from_cache: bool
    device_bytes: list[int] | None = None  # each emulated device's share of the weights (num_devices > 1)

    @property
    def num_slots(self) -> int:
        return self.specializations[1].batch_size

    @property
    def prefill_seq_len(self) -> int:
        return self.specializations[0].seq_len

    @property
    def ctx_len(self) -> int:
        return self.specializations[0].ctx_len

    @property
    def image_bytes(self) -> int:
        return sum(t.nbytes for t in self.weight_image.values())

    def describe(self) -> dict:
        return {"specializations": [asdict(s) for s in self.specializations], "build_options": self.build_options,
                "weight_image_bytes": self.image_bytes, "compile_seconds": round(self.compile_seconds, 3),
                "from_cache": self.from_cache, "device_weight_bytes": self.device_bytes}


def build_options(qaic: QaicConfig) -> dict:
    """The options the compiler takes, as QEfficient names them."""
    return {"num_cores": qaic.num_cores, "num_devices": qaic.num_devices, "mxfp6_matmul": qaic.mxfp6_matmul,
            "mxint8_kv_cache": qaic.mxint8_kv_cache, "aic_enable_depth_first": qaic.aic_enable_depth_first}


def compile_program(model: torch.nn.Module, qaic: QaicConfig, num_slots: int, model_path: str,
                    dtype: torch.dtype) -> QaicProgram:
    """The specializations for these shapes, and the weight image: from the cache when this artifact
    was compiled with these options before, else encoded now and stored."""
    started = time.perf_counter()
    specializations = [Specialization("prefill", 1, qaic.prefill_seq_len, qaic.ctx_len),
                       Specialization("decode", num_slots, 1, qaic.ctx_len)]
    options = build_options(qaic)
    image, from_cache = {}, False
    if qaic.mxfp6_matmul:
        folder = cache_dir_for(model_path, f"{FORMAT}|{dtype}")
        image, from_cache = _cached_image(folder)
        if not from_cache:
            image = encode_weights(model)
            _store_image(folder, image, specializations, options)
    return QaicProgram(specializations, options, image, time.perf_counter() - started, from_cache)


def _cached_image(folder: Path) -> tuple[dict[str, MXFP6Tensor], bool]:
    path, shapes = folder / "weights.safetensors", folder / "shapes.json"
    if not (path.exists() and shapes.exists()):
        return {}, False
    tensors, dims = load_file(str(path)), json.loads(shapes.read_text())
    return {name: MXFP6Tensor(tensors[f"{name}.packed"], tensors[f"{name}.scales"], tuple(shape))
            for name, shape in dims.items()}, True


def _store_image(folder: Path, image: dict[str, MXFP6Tensor], specializations, options: dict) -> None:
    tensors = {}
    for name, t in image.items():
        tensors[f"{name}.packed"], tensors[f"{name}.scales"] = t.packed.contiguous(), t.scales.contiguous()
    suffix = f".{os.getpid()}.tmp"  # several workers may compile at once: each renames its own whole file
    tmp = folder / f"weights.safetensors{suffix}"
    save_file(tensors, str(tmp))
    (folder / f"shapes.json{suffix}").write_text(json.dumps({n: list(t.shape) for n, t in image.items()}))
    (folder / "program.json").write_text(json.dumps(
        {"specializations": [asdict(s) for s in specializations], "build_options": options}, indent=1))
    os.replace(folder / f"shapes.json{suffix}", folder / "shapes.json")
    os.replace(tmp, folder / "weights.safetensors")
