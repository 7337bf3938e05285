"""The CUDA backend: bf16/fp16 (or float32) weights on the GPU, GEMMs through torch except a file's
quantized ones (quant_linear.py), our Triton kernels for everything else (kernels/), CUDA graphs for
decode steps, sampling on the device.

It also runs on the CPU under TRITON_INTERPRET=1 (no graphs, no memory profiling): that is how CI,
which has no GPU, checks its forward token for token against the torch backend.
"""

from __future__ import annotations

import time

import torch

from services.worker.backends.base import BackendInfo
from services.worker.backends.cuda.graphs import DecodeGraphs
from services.worker.backends.cuda.inputs import CudaInputs, build_inputs, span_limits, to_device
from services.worker.backends.cuda.memory import kv_budget, profile_peak
from services.worker.backends.cuda.ops import TritonOps
from services.worker.backends.cuda.quant_linear import kept_linears, quantize
from services.worker.backends.cuda.sampler import sample
from services.worker.backends.eagle3 import Eagle3Drafter
from services.worker.backends.kv_pool import KVSpec, null_block
from services.worker.backends.spec import WorkerSpec
from services.worker.draft_proposer import check_draft_model
from services.worker.images import ImageCache
from services.worker.loader import LoadedModel, load_model, refuse_encoder
from services.worker.logits_processors import SampleRow
from services.worker.models.eagle3 import load_eagle3
from services.worker.mrope import mrope_positions
from shared.config import FILES_OWN, ConfigError
from shared.control.deploy_config import FP8_KV_CACHE_DTYPES
from shared.engine_defaults import checkpoint_quantization, refuse_other_checkpoint
from shared.log import get_logger
from shared.wire.messages import BackendName, Logprobs, WorkerKind

log = get_logger("worker.cuda")


class CudaBackend:
    name = BackendName.CUDA
    kind = WorkerKind.PAGED

    def __init__(self, loaded: LoadedModel, kv: KVSpec, num_blocks: int, device: torch.device,
                 capture: tuple[int, int] | None = None):
        """capture: (max_num_seqs, max_seq_len_to_capture), the decode steps CUDA graphs are captured
        for; None: every step runs eagerly."""
        self.model = loaded.model
        self.config = loaded.config
        self.encoder = None  # encoders are refused at load (refuse_encoder)
        # an image-text model's images (services/worker/images.py): the tower's torch ops on the
        # device, its features in the embeddings; Gemma 3's image tokens seen both ways by the prefill
        # kernel (its rows' limits)
        self.images = ImageCache(self.model.vision, self.config.vision) if self.config.vision else None
        self.draft: Eagle3Drafter | CudaBackend | None = None  # an EAGLE-3 head, or a draft model over the same blocks
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.num_blocks = num_blocks
        self.kv_caches = kv.allocate(num_blocks, device)
        self.null_block = null_block(self.kv_caches)
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, self.null_block, *capture,
                                   self.config.num_kv_heads, self.num_sms) \
            if capture is not None and device.type == "cuda" else None

    @classmethod
    def create(cls, spec: WorkerSpec) -> CudaBackend:
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: this machine has no CUDA GPU that torch can use")
        if spec.quantization not in ("none", *FILES_OWN):
            raise ConfigError(f"quantization {spec.quantization!r} runs on the torch CPU backend only")
        refuse_other_checkpoint(spec.quantization, checkpoint_quantization(spec.model_path))
        if spec.kv_cache_dtype == "mxint8":
            raise ConfigError("kv_cache_dtype 'mxint8' is a QAIC format: it needs the qaic backend (--device qaic)")
        if spec.block_size < 16:
            raise ConfigError(f"the cuda backend needs block_size >= 16 (its kernels' tiles), got {spec.block_size}")
        device = torch.device("cuda", torch.cuda.current_device())
        dtype = spec.torch_dtype
        kv_dtype = torch.float8_e4m3fn if spec.kv_cache_dtype in FP8_KV_CACHE_DTYPES else spec.kv_torch_dtype  # e4m3, scale 1
        keeps = spec.quantization in FILES_OWN  # the file's integers (a checkpoint's, a GGUF's blocks), not floats
        loaded = _load(spec.model_path, spec, device, keeps)
        refuse_encoder(loaded, "cuda")
        head = draft = None  # loaded before the profile: their weights count
        if spec.draft_model_path and spec.draft_method == "eagle3":
            head, layers = load_eagle3(spec.draft_model_path, loaded.model, loaded.config, loaded.model.layers[0].attention.ops,
                                       dtype)
            head, loaded.model.aux_layers = head.to(device), tuple(layers)
        elif spec.draft_model_path:  # as its file holds it: a GGUF's or a quantized checkpoint's integers kept
            draft = check_draft_model(_load(spec.draft_model_path, spec, device, keeps=True), loaded)
        kv = KVSpec.of(loaded.config, spec.block_size, kv_dtype)
        drafter = head if head is not None else draft
        drafter_kv = KVSpec.of(drafter.config, spec.block_size, kv_dtype) if drafter is not None else None
        if spec.num_kv_blocks:
            num_blocks = spec.num_kv_blocks
        else:
            peak = profile_peak(loaded.model, kv, spec.max_num_batched_tokens, device)
            num_blocks = kv.num_blocks_for_budget(kv_budget(spec.gpu_memory_utilization, peak, device),
                                                  extra_per_block=drafter_kv.bytes_per_block if drafter_kv else 0)
        # MoE too: its expert sort stays on the device. With an EAGLE-3 head, eager steps: a graph's replay
        # would not give the streams the head reads
        capture = (spec.max_num_seqs, spec.max_seq_len_to_capture) if head is None else None
        log.info("cuda_backend", device=torch.cuda.get_device_name(device), dtype=spec.dtype,
                 kv_cache_dtype=str(kv_dtype), num_blocks=num_blocks, cuda_graphs=capture is not None)
        backend = cls(loaded, kv, num_blocks, device, capture=capture)
        if head is not None:
            backend.draft = Eagle3Drafter(head, drafter_kv, num_blocks, backend.prepare, device)
        if draft is not None:  # its one-token forwards replay graphs of its own
            backend.draft = cls(draft, drafter_kv, num_blocks, device, capture=capture)
        return backend

    def prepare(self, batch) -> CudaInputs:
        inputs = build_inputs(batch, self.block_size, self.null_block, self.device, self.config.num_kv_heads,
                              self.num_sms)
        if self.images is not None:
            embeds, spans = self.images.step_inputs(batch)
            if embeds is not None:
                inputs.image_embeds = (to_device(embeds[0], self.device), embeds[1])  # the features are on the device
            if self.model.images_see_both_ways:
                inputs.meta.prefill_limits = span_limits(batch, spans, self.device)
        if self.config.mrope_section and (positions := mrope_positions(batch, self.config.vision.token_pixels)) is not None:
            inputs.positions = to_device(positions, self.device)  # [T] for text alone: a graph takes it
        return inputs

    def forward(self, inputs: CudaInputs) -> torch.Tensor:
        if inputs.image_embeds is None and self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs)
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
        started = time.perf_counter()
        if self.graphs is not None:
            self.graphs.capture()
        if isinstance(self.draft, CudaBackend):
            self.draft.warm_up()
        return time.perf_counter() - started

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by KV block (the draft's over the same blocks too): what a block is."""
        caches = self.kv_caches + (self.draft.kv_caches if self.draft is not None else [])
        return [t for pair in caches for t in pair]

    def describe(self) -> BackendInfo:
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu, Triton interpreted"
        head = "" if self.draft is None else \
            f", EAGLE-3 head drafting from {self.draft.head.draft_vocab} tokens" if isinstance(self.draft, Eagle3Drafter) \
            else f", draft model {self.draft.config.architecture} of {self.draft.config.num_layers} layers"
        return BackendInfo(backend=self.name, kind=self.kind, num_blocks=self.num_blocks, block_size=self.block_size,
                           dtype=str(self.model.norm.weight.dtype).removeprefix("torch."),  # the table may be blocks
                           device=f"{self.device} ({device}{head})")


def _load(path: str, spec: WorkerSpec, device: torch.device, keeps: bool) -> LoadedModel:
    """A model on the device in spec's dtype; keeps: the file's quantized Linears stay its integers
    (quant_linear.py), else they are dequantized."""
    loaded = load_model(path, spec.load_format, spec.torch_dtype, ops=TritonOps(), device=device,
                        keep=kept_linears if keeps else None)
    if loaded.unloaded:
        quantize(loaded.model, loaded.blocks, loaded.unloaded).to(device)
    return loaded
