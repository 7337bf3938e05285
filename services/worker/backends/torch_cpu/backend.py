"""The torch CPU backend: the reference path (torch's ops, float32 exact against transformers), and
the fast path on the C kernels (quantized Linears, row ops, decode attention; optionally compiled)."""

from __future__ import annotations

import torch

from services.worker import memory
from services.worker.backends.base import BackendInfo
from services.worker.backends.eagle3 import Eagle3Drafter
from services.worker.backends.kv_pool import DTYPES, KVSpec, null_block
from services.worker.backends.spec import WorkerSpec, weight_bytes
from services.worker.backends.torch_cpu.compiled import BackgroundCompile
from services.worker.backends.torch_cpu.dense import pack_linears
from services.worker.backends.torch_cpu.huge_pages import move_to_huge_pages
from services.worker.backends.torch_cpu.inputs import TorchInputs, build_inputs
from services.worker.backends.torch_cpu.kernels.load import load as load_kernels
from services.worker.backends.torch_cpu.ops import NATIVE_OPS, TORCH_OPS
from services.worker.backends.torch_cpu.quantization import (
    KEEPS_BLOCKS,
    int8_activations,
    kept_weights,
    quantize,
)
from services.worker.draft_proposer import check_draft_model
from services.worker.images import ImageCache
from services.worker.loader import LoadedModel, load_model
from services.worker.logits_processors import SampleRow
from services.worker.models.eagle3 import Eagle3Head, load_eagle3
from services.worker.mrope import mrope_positions
from services.worker.sampler import sample
from shared.config import COMPILE_NICE, ConfigError
from shared.engine_defaults import QUANT_LINEAR
from shared.models.model_files import cache_root
from shared.wire.messages import BackendName, Logprobs, WorkerKind


class TorchCpuBackend:
    name = BackendName.TORCH_CPU
    kind = WorkerKind.PAGED
    device = torch.device("cpu")

    def __init__(self, loaded: LoadedModel, kv: KVSpec, num_blocks: int, compile_max_seqs: int = 0,
                 quantization: str = "none", compile_nice: int = COMPILE_NICE, quant_activations: str = "float32"):
        """`loaded`'s model already in its final form (quantized or packed); compile_max_seqs > 0:
        warm_up() compiles its decode layers in the background (compiled.py)."""
        self.model = loaded.model
        self.config = loaded.config
        self.encoder = loaded.model if getattr(loaded.model, "is_encoder", False) else None
        # an image-text model's images (services/worker/images.py)
        self.images = ImageCache(loaded.model.vision, loaded.config.vision) if loaded.config.vision else None
        self.kv = kv
        self.block_size = kv.block_size
        self.num_blocks = num_blocks
        self.kv_caches = kv.allocate(num_blocks)
        self.null_block = null_block(self.kv_caches)
        self.compile_max_seqs = compile_max_seqs
        self.compile_nice = compile_nice
        self.quantization = quantization
        self.quant_activations = quant_activations
        self.compiling: BackgroundCompile | None = None  # once warm_up() starts it
        self.native = self.model.layers[0].attention.ops.native  # the C kernels' ops (kernels/)
        self.draft: TorchCpuBackend | None = None  # speculative decoding's draft model, over the same blocks

    @classmethod
    def create(cls, spec: WorkerSpec) -> TorchCpuBackend:
        if spec.kv_cache_dtype not in DTYPES and spec.kv_cache_dtype != "auto":
            needs = "qaic" if spec.kv_cache_dtype == "mxint8" else "cuda"
            raise ConfigError(f"kv_cache_dtype {spec.kv_cache_dtype!r} needs the {needs} backend (--device {needs}); "
                              f"the cpu backend stores {', '.join(DTYPES)}")
        if spec.quantization == "mxfp6":
            raise ConfigError("quantization 'mxfp6' is a QAIC format: it needs the qaic backend (--device qaic)")
        native = not spec.deterministic and load_kernels().loaded
        if not native and (spec.quantization in QUANT_LINEAR or spec.compile):
            what = "--compile" if spec.compile else f"quantization {spec.quantization!r}"
            raise ConfigError(f"{what} runs on the C kernels, and {load_kernels().reason}")
        loaded = load_weights(spec.model_path, spec.load_format, spec.torch_dtype, native, spec.quantization)
        if getattr(loaded.model, "is_encoder", False) and (spec.compile or spec.quantization != "none"):
            what = "--compile" if spec.compile else f"quantization {spec.quantization!r}"
            raise ConfigError(f"{what}: {loaded.config.architecture} is an encoder, whose layers run on torch's own "
                              "ops (models/bert.py); serve it without")
        quantize(loaded.model, spec.quantization, loaded.blocks, loaded.unloaded)
        loaded.blocks = None  # the layers hold the weights in their own layout now
        if spec.quant_activations == "int8" and not int8_activations(loaded.model):
            raise ConfigError(f"--quant-activations int8 quantizes the rows into 4-, 5- or 6-bit weights, and this "
                              f"model has none under quantization {spec.quantization!r} (a GGUF's Q4_K ... Q6_K, "
                              "Q4_0/Q4_1, --quantization int4, an AWQ/GPTQ int4 checkpoint)")
        if not spec.compile:  # compiled layers cannot take oneDNN's packed weights (dense.py)
            pack_linears(loaded.model)
        # the weights as the steps read them, after every repacking above; the heap's freed pages go
        # back as they are copied (the loading's first), so that the copies raise no peak
        move_to_huge_pages(loaded.model, then=memory.trim)
        draft = head = None
        if spec.draft_model_path and spec.draft_method == "eagle3":
            if spec.compile:
                raise ConfigError("speculative_config: the eagle3 method reads the streams between the model's "
                                  "layers, which a compiled step runs as one graph; serve it without --compile")
            head, loaded.model.aux_layers = _eagle3(spec, loaded)
        elif spec.draft_model_path:
            draft = _draft(spec, native, loaded)
        kv = KVSpec.of(loaded.config, spec.block_size, spec.kv_torch_dtype)
        draft_kv = KVSpec.of((draft or head).config, spec.block_size, spec.kv_torch_dtype) if draft or head else None
        # a draft's KV lives in the same blocks (its own layers' tensors): each block holds both
        drafter_bytes = weight_bytes(draft.model) if draft else weight_bytes(head) if head else 0
        budget = spec.kv_cache_bytes(weight_bytes(loaded.model) + drafter_bytes)
        num_blocks = spec.num_kv_blocks or kv.num_blocks_for_budget(
            budget, extra_per_block=draft_kv.bytes_per_block if draft_kv else 0)
        backend = cls(loaded, kv, num_blocks, compile_max_seqs=spec.max_num_seqs if spec.compile else 0,
                      compile_nice=spec.compile_nice,
                      quantization=spec.quantization, quant_activations=spec.quant_activations)
        if draft is not None:
            backend.draft = cls(draft, draft_kv, num_blocks, quantization="gguf" if native else "none")
        if head is not None:
            backend.draft = Eagle3Drafter(pack_linears(head), draft_kv, num_blocks, backend.prepare)
        return backend

    def prepare(self, batch) -> TorchInputs:
        inputs = build_inputs(batch, self.block_size, self.null_block)
        if self.images is not None:
            inputs.image_embeds, spans = self.images.step_inputs(batch)
            if self.model.images_see_both_ways:
                inputs.meta.bidirectional = spans
        if self.config.mrope_section and (positions := mrope_positions(batch, self.config.vision.token_pixels)) is not None:
            inputs.positions = positions
        return inputs

    def forward(self, inputs: TorchInputs) -> torch.Tensor:
        if self.images is None:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        self.model.image_embeds = inputs.image_embeds
        try:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        finally:
            self.model.image_embeds = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[Logprobs | None]]:
        return sample(logits, rows)

    def warm_up(self) -> float:
        """Starts the background compile (the worker serves eagerly meanwhile); returns at once."""
        if self.compile_max_seqs and self.compiling is None:
            self.compiling = BackgroundCompile(self.model, self.kv_caches, self.block_size, self.compile_max_seqs,
                                               cache_root() / "compile-probe", self.compile_nice)
        return 0.0

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by KV block (the draft's over the same blocks too): what a block is."""
        caches = self.kv_caches + (self.draft.kv_caches if self.draft is not None else [])
        return [t for pair in caches for t in pair]

    def describe(self) -> BackendInfo:
        """The device line says what computes: it changes when a background compile ends (or fails)."""
        dense = self.model.norm if hasattr(self.model, "norm") else self.model.tok_embeddings  # BERT has no final norm
        dtype = str(dense.weight.dtype).removeprefix("torch.")
        how = [dtype] + [f"{self.quantization} weights"] * (self.quantization != "none") + \
            [f"{self.quant_activations} activations"] * (self.quant_activations != "float32") + \
            [load_kernels().reason] * self.native + ([self.compiling.state] if self.compiling else []) + \
            ([_drafter(self.draft)] if self.draft else [])
        return BackendInfo(backend=self.name, kind=self.kind, num_blocks=self.num_blocks, block_size=self.block_size,
                           dtype=dtype, device=f"cpu ({', '.join(how)})")



def load_weights(path: str, load_format: str, dtype: torch.dtype, native: bool, quantization: str) -> LoadedModel:
    """A model's file loaded for `quantization` (quantize() next): under a method that keeps the
    file's blocks (KEEPS_BLOCKS) they are never dequantized, the embedding table's included."""
    keeps_blocks = quantization in KEEPS_BLOCKS
    return load_model(path, load_format, dtype, ops=NATIVE_OPS if native else TORCH_OPS,
                      keep=kept_weights if keeps_blocks else None)


def load_as_filed(path: str, spec: WorkerSpec, native: bool) -> LoadedModel:
    """A model as its file holds it, run eagerly: a GGUF's or a quantized checkpoint's blocks kept on
    the C kernels (quantization `gguf`: every file's own, shared.config.FILES_OWN), float weights
    packed as they are; on torch's ops (not native) dequantized."""
    method = "gguf" if native else "none"
    loaded = load_weights(path, spec.load_format, spec.torch_dtype, native, method)
    quantize(loaded.model, method, loaded.blocks, loaded.unloaded)
    pack_linears(loaded.model)
    return loaded


def _draft(spec: WorkerSpec, native: bool, target: LoadedModel) -> LoadedModel:
    """Speculative decoding's draft model as its file holds it, whatever the target's quantization."""
    return check_draft_model(load_as_filed(spec.draft_model_path, spec, native), target)


def _eagle3(spec: WorkerSpec, target: LoadedModel) -> tuple[Eagle3Head, tuple[int, ...]]:
    """Speculative decoding's EAGLE-3 head, in the target's dtype, and the target layers it reads."""
    ops = target.model.layers[0].attention.ops
    head, layers = load_eagle3(spec.draft_model_path, target.model, target.config, ops, spec.torch_dtype)
    return head, tuple(layers)


def _drafter(draft) -> str:
    if isinstance(draft, Eagle3Drafter):
        return f"EAGLE-3 head drafting from {draft.head.draft_vocab} tokens"
    return f"draft model {draft.config.architecture} of {draft.config.num_layers} layers"
