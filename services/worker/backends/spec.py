"""What a worker asks of its backend: the model, the dtypes and the KV budget (from flags or a deployment)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.backends.kv_pool import DTYPES, kv_dtype_for
from shared.config import COMPILE_NICE, DEFAULTS
from shared.control.deploy_config import QaicConfig


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, and what a module holds outside them (w8a8's weights, packed by fbgemm)."""
    held = sum(getattr(m, "packed_bytes", 0) for m in model.modules())
    return held + sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@dataclass
class WorkerSpec:
    model_path: str
    kv_cache_bytes: Callable[[int], int]  # the weights' bytes -> the KV pool's budget (CPU backends)
    load_format: str = DEFAULTS.load_format
    dtype: str = "float32"  # or bfloat16, float16; "auto" until with_dtype_for()
    quantization: str = "none"  # what the backend runs ("auto" settled by shared/engine_defaults.py)
    kv_cache_dtype: str = DEFAULTS.kv_cache_dtype
    block_size: int = DEFAULTS.block_size
    num_kv_blocks: int | None = None  # overrides every budget
    max_num_seqs: int = DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens  # the largest step (CUDA profiles its activations)
    compile: bool = False
    compile_nice: int = COMPILE_NICE  # the background compile's niceness
    quant_activations: str = "float32"  # CPU: int8 rows into the 4- to 6-bit weights' kernel (quant_dot.c)
    deterministic: bool = False  # CPU: batch-invariant float32 on torch's ops alone (no C kernels)
    gpu_memory_utilization: float = DEFAULTS.gpu_memory_utilization  # CUDA: the device memory's share
    max_seq_len_to_capture: int = DEFAULTS.max_seq_len_to_capture  # CUDA: longer decode contexts run without graphs
    qaic: QaicConfig | None = None  # QAIC: the program's shapes and formats
    draft_model_path: str | None = None  # speculative decoding's draft model (the local file or folder)
    draft_method: str = "draft_model"  # what the draft path holds: a model, or an EAGLE-3 head ("eagle3")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def with_dtype_for(self, device: str) -> WorkerSpec:
        """`auto` made concrete: float32 on the CPU (exact, batch-invariant; the QAIC emulator runs
        there too), bfloat16 on a GPU."""
        if self.dtype != "auto":
            return self
        return dataclasses.replace(self, dtype="float32" if device in ("cpu", "qaic") else "bfloat16")

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return kv_dtype_for(self.kv_cache_dtype, self.torch_dtype)

    def kv_budget(self, model: torch.nn.Module) -> int:
        return self.kv_cache_bytes(weight_bytes(model))
