"""The backend seam: the CPU worker never imports triton, a backend is picked by --device and
refuses what it cannot run, and the CUDA backend's graphs are chosen by max_seq_len_to_capture."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.worker.backends import create_backend
from services.worker.backends.spec import WorkerSpec
from shared.config import ConfigError


def test_the_cpu_worker_never_imports_triton():
    code = ("import sys, services.worker.__main__, services.worker.backends.torch_cpu.backend; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_launcher_reads_the_kernels_build_without_importing_torch():
    """It prints the CPU worker's picks, which depend on the C kernels' build, before any service starts."""
    code = ("import sys, switchyard.launcher; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backends_refuse_what_they_cannot_run(default_model_path):
    spec = WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: 2**26)
    with pytest.raises(ConfigError, match="--device must be one of cpu, cuda, qaic, got 'tpu'"):
        create_backend("tpu", spec)
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8' needs the cuda backend"):
        create_backend("cpu", WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: 2**26,
                                         kv_cache_dtype="fp8"))
    with pytest.raises(ConfigError, match="kv_cache_dtype 'mxint8' needs the qaic backend"):
        create_backend("cpu", WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: 2**26,
                                         kv_cache_dtype="mxint8"))
    with pytest.raises(ConfigError, match="quantization 'mxfp6' is a QAIC format"):
        create_backend("cpu", WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: 2**26,
                                         quantization="mxfp6"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="this machine has no CUDA GPU"):
            create_backend("cuda", spec)
    assert spec.with_dtype_for("cpu").dtype == "float32" and spec.with_dtype_for("cuda").dtype == "float32"
    auto = WorkerSpec(model_path="m", kv_cache_bytes=lambda _: 0, dtype="auto")
    assert [auto.with_dtype_for(d).dtype for d in ("cpu", "cuda", "qaic")] == ["float32", "bfloat16", "float32"]


def test_decode_graphs_take_decode_steps_up_to_max_seq_len_to_capture():
    from services.worker.backends.cuda.graphs import DecodeGraphs, capture_sizes
    from services.worker.backends.cuda.inputs import build_inputs
    from services.worker.lora.layers import LoraRows, LoraState
    from services.worker.sequence import SeqState
    from shared.wire.messages import SamplingParams

    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    caches = [(torch.zeros(9, 2, 16, 8), torch.zeros(9, 2, 16, 8))]
    graphs = DecodeGraphs(None, caches, block_size=16, null_block=8, max_num_seqs=4, max_seq_len_to_capture=64,
                          num_kv_heads=2, num_sms=4)
    graphs.graphs = dict.fromkeys(graphs.sizes)  # as if captured

    def inputs(contexts: list[int], num_new: int = 1):
        seqs = [SeqState(request_id=str(i), token_ids=[1] * (n + num_new), num_prompt_tokens=n + num_new,
                         num_computed_tokens=n, block_table=[0, 1, 2, 3, 4, 5], sampling=SamplingParams(),
                         reply_to="", num_cached_tokens=0, first_scheduled_at=0.0) for i, n in enumerate(contexts)]
        return build_inputs([(s, num_new) for s in seqs], 16, 8, torch.device("cpu"), 2, 4)

    assert graphs.can_run(inputs([10, 63]))  # contexts 11 and 64
    assert not graphs.can_run(inputs([10, 64]))  # a context of 65: past max_seq_len_to_capture, eager
    assert not graphs.can_run(inputs([1, 2, 3, 4, 5]))  # more rows than the largest graph
    assert not graphs.can_run(inputs([10], num_new=5))  # a prefill chunk
    graphs.model = torch.nn.Module()  # a model with LoRA slots: a step with adapter rows runs eagerly
    graphs.model.lora = LoraState()
    assert graphs.can_run(inputs([10, 63]))
    graphs.model.lora.rows = LoraRows.of([0, -1], [1, 1], torch.device("cpu"))
    assert not graphs.can_run(inputs([10, 63]))


def test_a_qaic_config_on_another_device_is_refused():
    run = subprocess.run([sys.executable, "-m", "services.worker", "--device", "cpu", "--qaic-config",
                          '{"ctx_len": 64}'], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "--qaic-config configures the qaic backend; this worker's device is 'cpu'" in run.stderr


@pytest.mark.parametrize("device,because", [("cuda", "captures CUDA graphs of its own"),
                                            ("qaic", "runs its compiled program")])
def test_compile_on_another_device_is_refused_not_ignored(device, because):
    env = {k: v for k, v in os.environ.items() if k != "SY_DETERMINISTIC"}  # refused too, first, on cuda
    run = subprocess.run([sys.executable, "-m", "services.worker", "--device", device, "--compile"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0
    assert f"--compile compiles the cpu backend's decode steps; the {device} backend {because}" in run.stderr


def test_int8_activations_go_to_the_c_kernels_of_4_to_6_bit_weights_only(default_model_path, cpu_kernels, monkeypatch):
    """--quant-activations int8 (SY_QUANT_ACTIVATIONS): the default GGUF's Q4_1 Linears take int8 rows
    and the device line says so; a model without such weights, --deterministic and other devices refuse it."""
    from services.worker.__main__ import parse_args
    from services.worker.backends.torch_cpu.quantization import QuantLinear
    from services.worker.settings import resolve

    backend = create_backend("cpu", WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: 2**26,
                                               quantization="gguf", quant_activations="int8", num_kv_blocks=8))
    takers = [m for m in backend.model.modules() if isinstance(m, QuantLinear)]
    assert sum(m.int8_activations for m in takers) > 60  # its Q4_1 ones; its Q8_0 ones keep float rows
    assert all(m.int8_activations == (m.bits == 4) for m in takers)
    assert "int8 activations" in backend.describe().device
    with pytest.raises(ConfigError, match="this model has none under quantization 'none'"):
        create_backend("cpu", WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: 2**26,
                                         quant_activations="int8", num_kv_blocks=8))
    monkeypatch.setattr(sys, "argv", ["worker", "--model-path", default_model_path, "--deterministic"])
    monkeypatch.setenv("SY_QUANT_ACTIVATIONS", "int8")
    with pytest.raises(ConfigError, match=r"--quant-activations int8 is the cpu backend's C kernels' \(--deterministic"):
        resolve(parse_args())
    monkeypatch.setattr(sys, "argv", ["worker", "--model-path", default_model_path])
    assert resolve(parse_args()).quant_activations == "int8"
