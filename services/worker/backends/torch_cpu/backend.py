"""The torch CPU backend: the reference path (float32 exact against transformers), and fast paths
on CPU kernels (oneDNN-packed float32, weight-only int8/int4, w8a8, compiled decode layers)."""

from __future__ import annotations

import torch

from services.worker.backends.kv_pool import DTYPES, KVSpec, null_block
from services.worker.backends.spec import WorkerSpec
from services.worker.backends.torch_cpu import decode_kernel, fused_ops
from services.worker.backends.torch_cpu.compiled import compile_in_background
from services.worker.backends.torch_cpu.dense import pack_linears
from services.worker.backends.torch_cpu.inputs import TorchInputs, build_inputs
from services.worker.backends.torch_cpu.ops import TORCH_OPS, TorchOps
from services.worker.backends.torch_cpu.quantization import native_int4_blocks, quantize
from services.worker.loader import LoadedModel, load_model
from services.worker.logits_processors import SampleRow
from services.worker.sampler import sample
from shared.config import ConfigError
from shared.messages import BackendName, Logprobs, WorkerKind


class TorchCpuBackend:
    name = BackendName.TORCH_CPU
    kind = WorkerKind.PAGED
    device = torch.device("cpu")

    def __init__(self, loaded: LoadedModel, kv: KVSpec, num_blocks: int, compile_max_seqs: int = 0,
                 quantization: str = "none"):
        """`loaded`'s model already in its final form (quantized or packed); compile_max_seqs > 0:
        warm_up() compiles its decode layers in the background (compiled.py)."""
        self.model = loaded.model
        self.config = loaded.config
        self.kv = kv
        self.block_size = kv.block_size
        self.num_blocks = num_blocks
        self.kv_caches = kv.allocate(num_blocks)
        self.null_block = null_block(self.kv_caches)
        self.compile_max_seqs = compile_max_seqs
        self.quantization = quantization
        self.compiling = None  # the background compile's thread, once started
        # the eager steps' decode attention and row-wise ops in C (decode_kernel.py, fused_ops.py)
        ops = self.model.layers[0].attention.ops
        self.c_attention, self.c_row_ops = ops.decode_kernel is not None, ops.fused is not None

    @classmethod
    def create(cls, spec: WorkerSpec) -> TorchCpuBackend:
        if spec.kv_cache_dtype not in DTYPES and spec.kv_cache_dtype != "auto":
            needs = "qaic" if spec.kv_cache_dtype == "mxint8" else "cuda"
            raise ConfigError(f"kv_cache_dtype {spec.kv_cache_dtype!r} needs the {needs} backend (--device {needs}); "
                              f"the cpu backend stores {', '.join(DTYPES)}")
        if spec.quantization == "mxfp6":
            raise ConfigError("quantization 'mxfp6' is a QAIC format: it needs the qaic backend (--device qaic)")
        ops = TORCH_OPS if spec.deterministic else TorchOps(decode_kernel.load(), fused_ops.load())
        loaded = load_model(spec.model_path, spec.load_format, spec.torch_dtype, ops)
        quantize(loaded.model, spec.quantization, native_int4_blocks(loaded, spec.quantization))
        if not spec.compile:  # compiled layers cannot take oneDNN's packed weights (dense.py)
            pack_linears(loaded.model)
        kv = KVSpec.of(loaded.config, spec.block_size, spec.kv_torch_dtype)
        num_blocks = spec.num_kv_blocks or kv.num_blocks_for_budget(spec.kv_budget(loaded.model))
        return cls(loaded, kv, num_blocks, compile_max_seqs=spec.max_num_seqs if spec.compile else 0,
                   quantization=spec.quantization)

    def prepare(self, batch) -> TorchInputs:
        return build_inputs(batch, self.block_size, self.null_block)

    def forward(self, inputs: TorchInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[Logprobs | None]]:
        return sample(logits, rows)

    def warm_up(self) -> float:
        """Starts the background compile (the worker serves eagerly meanwhile); returns at once."""
        if self.compile_max_seqs and self.compiling is None:
            self.compiling = compile_in_background(self.model, self.kv_caches, self.block_size, self.compile_max_seqs)
        return 0.0

    def hello_fields(self) -> dict:
        dtype = str(self.model.tok_embeddings.weight.dtype).removeprefix("torch.")
        how = [dtype] + [f"{self.quantization} weights"] * (self.quantization != "none") + \
            ["compiled decode"] * bool(self.compile_max_seqs) + ["C decode attention"] * self.c_attention + \
            ["C row ops"] * self.c_row_ops
        return {"backend": self.name, "kind": self.kind, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "dtype": dtype, "device": f"cpu ({', '.join(how)})"}
