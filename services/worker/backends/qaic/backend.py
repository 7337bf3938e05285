"""The QAIC backend: Cloud AI 100's execution model, a program of two fixed shapes over dense
per-slot KV (program.py), MXFP6 weights and MXINT8 KV as packed storage; emulated when the host
has no cards (on its GPU if it has one, else on the CPU), and saying so (runtime.py)."""

from __future__ import annotations

import time

import msgspec
import torch

from services.worker.backends.base import BackendInfo
from services.worker.backends.qaic import runtime
from services.worker.backends.qaic.devices import EmulatedDevices, slice_across
from services.worker.backends.qaic.inputs import QaicInputs, SlotMeta, build_inputs
from services.worker.backends.qaic.kv_slots import SlotKVSpec
from services.worker.backends.qaic.mx_linear import install
from services.worker.backends.qaic.ops import QAIC_OPS
from services.worker.backends.qaic.program import QaicProgram, compile_program
from services.worker.backends.spec import WorkerSpec
from services.worker.backends.torch_cpu.dense import pack_linears
from services.worker.loader import LoadedModel, load_model, refuse_encoder, refuse_images
from services.worker.logits_processors import SampleRow
from services.worker.sampler import sample
from shared.config import ConfigError
from shared.control.deploy_config import QaicConfig
from shared.log import get_logger
from shared.wire.messages import BackendName, Logprobs, WorkerKind

log = get_logger("worker.qaic")


def emulated_on(device: torch.device) -> str:
    return f"qaic, emulated on {device.type}"


EMULATED_ON = emulated_on(torch.device("cpu"))


def compute_threads(qaic: QaicConfig, host_cpus: int) -> int:
    """Each emulated device computes with num_cores threads (the cores of one SoC), as many as the
    host's CPUs allow when every device runs at once."""
    return max(1, min(qaic.num_cores, host_cpus // qaic.num_devices))


class QaicBackend:
    name = BackendName.QAIC
    kind = WorkerKind.SLOTS

    def __init__(self, loaded: LoadedModel, program: QaicProgram, kv: SlotKVSpec, device: torch.device):
        self.model = loaded.model
        self.config = loaded.config
        self.encoder = None  # encoders are refused at load (refuse_encoder)
        self.images = None  # image-text models are refused at load (refuse_images)
        self.draft = None  # speculative decoding's draft_model method runs on the cpu backend alone
        self.program = program
        self.kv = kv
        self.device = device  # the emulator's
        self.block_size = kv.ctx_len
        self.num_blocks = program.num_slots
        self.kv_caches = kv.allocate(program.num_slots, device)

    @classmethod
    def create(cls, spec: WorkerSpec, device: str | None = None) -> QaicBackend:
        """device: where the emulator runs (default: the GPU when the host has one, else the CPU)."""
        qaic = (spec.qaic or QaicConfig()).validate()
        mxfp6 = qaic.mxfp6_matmul or spec.quantization == "mxfp6"
        mxint8 = qaic.mxint8_kv_cache or spec.kv_cache_dtype == "mxint8"
        if spec.quantization not in ("none", "mxfp6"):
            raise ConfigError(f"quantization {spec.quantization!r} is not a QAIC format: use mxfp6 (or none)")
        qaic = msgspec.structs.replace(qaic, mxfp6_matmul=mxfp6, mxint8_kv_cache=mxint8)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        loaded = load_model(spec.model_path, spec.load_format, spec.torch_dtype, ops=QAIC_OPS, device=device)
        refuse_encoder(loaded, "qaic")
        unsupported = ("its image tokens' two-way attention a mask the decoder's specializations do not take"
                       if getattr(loaded.model, "images_see_both_ways", False) else
                       "M-RoPE's three positions a token an input the decoder's program does not take")
        refuse_images(loaded, "qaic", f"its vision tower would be a second compiled program, and {unsupported} "
                                      "(docs/qaic.md)")
        program = compile_program(loaded.model, qaic, qaic.full_batch_size or spec.max_num_seqs, spec.model_path,
                                  spec.torch_dtype)
        if runtime.detect() is not None:
            runtime.load(program)  # refuses: the cards are not driven yet (runtime.py)
        if mxfp6:
            install(loaded.model, program.weight_image, spec.torch_dtype, device)
        if qaic.num_devices > 1:
            program.device_bytes = slice_across(loaded.model, EmulatedDevices(qaic.num_devices))
        if device.type == "cpu":
            pack_linears(loaded.model)  # float32 Linears (not MXFP6) on oneDNN, as the torch CPU backend's
        # MXINT8 is decoded into the compute dtype; otherwise K/V are stored as kv_cache_dtype says
        kv = SlotKVSpec.of(loaded.config, qaic.ctx_len, spec.torch_dtype if mxint8 else spec.kv_torch_dtype, mxint8)
        log.info("qaic_program", device=emulated_on(device), **program.describe())
        return cls(loaded, program, kv, device)

    def prepare(self, batch) -> QaicInputs:
        inputs = build_inputs(batch, self.program.num_slots, self.program.prefill_seq_len, self.kv.ctx_len)
        return inputs.to(self.device)

    def forward(self, inputs: QaicInputs) -> torch.Tensor:
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return hidden.index_select(0, inputs.rows)  # the fixed shape's rows back in the batch's order

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[Logprobs | None]]:
        return sample(logits.cpu(), rows)  # the reference sampler, on the host

    @torch.inference_mode()
    def warm_up(self) -> float:
        """One run of each specialization on padding alone (every write lands in the drop column),
        so the first request does not pay for first-run allocations."""
        started = time.perf_counter()
        slots, chunk, ctx_len = self.program.num_slots, self.program.prefill_seq_len, self.kv.ctx_len
        for batch, length in ((1, chunk), (slots, 1)):
            positions = torch.arange(length).clamp(max=ctx_len - 1).repeat(batch)
            meta = SlotMeta(torch.arange(batch), torch.full((batch, length), ctx_len), positions.view(batch, length))
            self.forward(QaicInputs(torch.zeros(batch * length, dtype=torch.long), positions, meta,
                                    torch.zeros(0, dtype=torch.long), "warm-up").to(self.device))
        return time.perf_counter() - started

    def kv_tensors(self) -> list[torch.Tensor]:
        """None: a slot is a whole sequence's context, not blocks the host tier could keep."""
        return []

    def describe(self) -> BackendInfo:
        return BackendInfo(backend=self.name, kind=self.kind, num_blocks=self.num_blocks, block_size=self.block_size,
                           prefill_seq_len=self.program.prefill_seq_len,
                           dtype=str(self.model.tok_embeddings.weight.dtype).removeprefix("torch."),
                           kv_cache_dtype="mxint8" if self.kv.mxint8 else str(self.kv.dtype).removeprefix("torch."),
                           device=emulated_on(self.device))
