"""The QAIC emulator on a real GPU (where the host has no Cloud AI 100 cards but a GPU, the program
runs there): the same greedy tokens as the emulator on the CPU, float32, with and without the MX
formats, across devices. Skipped without a GPU (CI has none); run on a lent one:
    python -m pytest tests/gpu
"""

from __future__ import annotations

import pytest
import torch

from services.scheduler.slot_manager import SlotManager
from services.scheduler.slot_scheduler import SlotScheduler
from services.worker.backends.qaic.backend import QaicBackend
from services.worker.backends.spec import WorkerSpec
from services.worker.model_runner import ModelRunner
from shared.control.deploy_config import QaicConfig
from tests.inproc_engine import InProcessEngine
from tests.test_llama_vs_hf import PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def generate(path: str, device: str, hf_tokenizer, **formats) -> dict[str, list[int]]:
    config = QaicConfig(full_batch_size=4, ctx_len=256, prefill_seq_len=32, **formats)
    spec = WorkerSpec(model_path=path, kv_cache_bytes=lambda _: 0, qaic=config).with_dtype_for("qaic")
    backend = QaicBackend.create(spec, device=device)
    assert backend.describe().device == f"qaic, emulated on {device}"
    runner = ModelRunner(backend, max_model_len=256, eos_token_ids=backend.config.eos_token_ids)
    engine = InProcessEngine(None, 16, runner=runner, scheduler=SlotScheduler(SlotManager(4, 256), 32))
    for i, prompt in enumerate(PROMPTS):
        engine.add(f"r{i}", hf_tokenizer.encode(prompt), 24, ignore_eos=True)
    return engine.run()


@pytest.mark.parametrize("formats", [{}, {"mxfp6_matmul": True, "mxint8_kv_cache": True, "num_devices": 2}])
def test_the_program_on_the_gpu_gives_the_cpu_emulators_tokens(default_model_path, hf_tokenizer, formats):
    gpu = generate(default_model_path, "cuda", hf_tokenizer, **formats)
    cpu = generate(default_model_path, "cpu", hf_tokenizer, **formats)
    parted = {k: next((i for i, (a, b) in enumerate(zip(cpu[k], gpu[k], strict=True)) if a != b), None) for k in cpu}
    # float32 on both, summed in other orders (cuBLAS, oneDNN): a near-tie may be decided otherwise,
    # and the two continuations part there (on an H100, one request of four at token 12 with the MX
    # formats); none parts before its 8th token
    assert all(p is None or p >= 8 for p in parted.values()), parted
