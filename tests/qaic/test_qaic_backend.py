"""The QAIC emulator against the torch backend: the same tokens through its two fixed shapes (chunked
prefill at batch 1, decode over all slots) on a random Llama with GQA; MXFP6 weights computing
exactly what they store; the program's bytes at the MX formats' ratios; its cache."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.slot_manager import SlotManager
from services.scheduler.slot_scheduler import SlotScheduler
from services.worker.backends.qaic.backend import EMULATED_ON, QaicBackend, compute_threads
from services.worker.backends.qaic.devices import SlicedLinear
from services.worker.backends.qaic.mx import int8_decode
from services.worker.backends.qaic.mx_linear import MXFP6Linear, linears
from services.worker.backends.spec import WorkerSpec
from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from shared.config import ConfigError
from shared.control.deploy_config import QaicConfig
from shared.wire.messages import WorkerKind
from tests.inproc_engine import InProcessEngine

CTX_LEN, CHUNK, SLOTS = 96, 16, 3


@pytest.fixture(autouse=True)
def program_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def qaic_backend(path: str, kv_cache_dtype: str = "auto", **qaic) -> QaicBackend:
    config = QaicConfig(num_cores=2, full_batch_size=SLOTS, ctx_len=CTX_LEN, prefill_seq_len=CHUNK, **qaic)
    spec = WorkerSpec(model_path=path, load_format="dummy", kv_cache_bytes=lambda _: 0, qaic=config,
                      kv_cache_dtype=kv_cache_dtype)
    return QaicBackend.create(spec.with_dtype_for("qaic"), device="cpu")  # against the torch CPU path


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 299, (n,), generator=gen).tolist() for n in (40, 3, 17, 1, 16)]


def run_qaic(backend: QaicBackend, loaded, max_tokens: int = 12) -> dict[str, list[int]]:
    runner = ModelRunner(backend, max_model_len=CTX_LEN, eos_token_ids=backend.config.eos_token_ids)
    engine = InProcessEngine(loaded, num_blocks=16, runner=runner,
                             scheduler=SlotScheduler(SlotManager(SLOTS, CTX_LEN), CHUNK))
    for i, ids in enumerate(prompts()):  # five requests for three slots: two wait for one to free
        engine.add(f"r{i}", ids, max_tokens, ignore_eos=True)
    return engine.run()


def run_torch(loaded, max_tokens: int = 12) -> dict[str, list[int]]:
    engine = InProcessEngine(loaded, num_blocks=64)
    for i, ids in enumerate(prompts()):
        engine.add(f"r{i}", ids, max_tokens, ignore_eos=True)
    return engine.run()


@pytest.mark.parametrize("family", ["small_llama", "small_qwen3", "small_qwen3_moe", "small_gemma3",
                                    "small_gemma2"])
def test_the_static_shapes_give_the_torch_backends_tokens(request, family):
    config = request.getfixturevalue(family)
    backend = qaic_backend(config)
    assert backend.kind == WorkerKind.SLOTS and backend.describe().device == EMULATED_ON
    assert run_qaic(backend, backend) == run_torch(load_model(config, "dummy", ops=TORCH_OPS))


def test_mxfp6_weights_compute_exactly_what_they_store(small_llama):
    backend = qaic_backend(small_llama, mxfp6_matmul=True)
    reference = load_model(small_llama, "dummy", ops=TORCH_OPS)
    stored = {name: m for name, m in backend.model.named_modules() if isinstance(m, MXFP6Linear)}
    assert len(stored) == 2 * 4 + 1  # wqkv, wo, w13, w2 per layer, and the output head
    for name, _, _, linear in linears(reference.model):  # the torch path over the decoded MXFP6 values
        linear.weight = torch.nn.Parameter(stored[name].weight.clone(), requires_grad=False)
    assert run_qaic(backend, backend) == run_torch(reference)


def test_mxint8_kv_agrees_with_the_float_cache_and_the_bytes_are_at_the_formats_ratios(small_llama):
    exact, mx = qaic_backend(small_llama), qaic_backend(small_llama, mxfp6_matmul=True, mxint8_kv_cache=True)
    assert mx.describe().kv_cache_dtype == "mxint8"
    a, b = run_qaic(exact, exact), run_qaic(mx, mx)
    agree = sum(x == y for k in a for x, y in zip(a[k], b[k], strict=True)) / sum(len(v) for v in a.values())
    assert agree > 0.5  # random weights have flat logits: MX rounding flips some argmaxes
    # 6.25 bits a weight (against bfloat16's 16), 8.25 bits a cached K/V element
    weights = sum(m.shape[0] * m.shape[1] for m in mx.model.modules() if isinstance(m, MXFP6Linear))
    assert mx.program.image_bytes * 8 / weights == 6.25
    bf16_kv = 2 * 2 * 2 * 32 * 2  # layers x (K, V) x kv_heads x head_dim x 2 bytes
    assert kv_bytes_per_token(mx) * 16 / bf16_kv == 8.25
    cache = mx.kv_caches[0]
    assert cache.k.dtype == torch.int8 and cache.nbytes == 2 * SLOTS * 2 * (CTX_LEN + 1) * (32 + 1)
    for codes, scales, values in ((cache.k, cache.k_scales, cache.k_values),
                                  (cache.v, cache.v_scales, cache.v_values)):
        # what attention reads is the codes' own decoding
        assert torch.equal(values, int8_decode(codes, scales, values.dtype))
    bf16 = qaic_backend(small_llama, kv_cache_dtype="bfloat16")  # without mxint8: kv_cache_dtype's
    assert bf16.kv_caches[0].k.dtype == torch.bfloat16 and kv_bytes_per_token(bf16) == bf16_kv


def kv_bytes_per_token(backend) -> float:
    """What the allocated caches hold per token, over all layers (a slot has ctx_len + 1 positions)."""
    return sum(c.nbytes for c in backend.kv_caches) / (SLOTS * (CTX_LEN + 1))


def test_the_compiled_program_is_cached(small_llama, program_cache):
    first = qaic_backend(small_llama, mxfp6_matmul=True)
    again = qaic_backend(small_llama, mxfp6_matmul=True)
    assert not first.program.from_cache and again.program.from_cache
    assert (program_cache / next(iter(p.name for p in program_cache.iterdir())) / "program.json").exists()
    for name, t in first.program.weight_image.items():
        assert torch.equal(t.packed, again.program.weight_image[name].packed)
    described = first.program.describe()
    assert described["specializations"] == [
        {"name": "prefill", "batch_size": 1, "seq_len": CHUNK, "ctx_len": CTX_LEN},
        {"name": "decode", "batch_size": SLOTS, "seq_len": 1, "ctx_len": CTX_LEN}]
    assert described["build_options"]["aic_enable_depth_first"] is False


def test_a_program_sliced_across_devices_gives_the_same_tokens(small_llama):
    one = qaic_backend(small_llama, mxfp6_matmul=True)
    three = qaic_backend(small_llama, mxfp6_matmul=True, num_devices=3)
    sliced = [m for m in three.model.modules() if isinstance(m, SlicedLinear)]
    assert len(sliced) == 9 and all(len(m.shards) == 3 for m in sliced)
    assert sum(three.program.device_bytes) == one.program.image_bytes  # each device holds its slice, no more
    assert max(three.program.device_bytes) - min(three.program.device_bytes) < one.program.image_bytes // 9
    assert run_qaic(three, three) == run_qaic(one, one)
    assert compute_threads(QaicConfig(num_cores=16, num_devices=4), host_cpus=2) == 1
    assert compute_threads(QaicConfig(num_cores=4, num_devices=2), host_cpus=16) == 4


def test_what_the_emulator_refuses(small_llama):
    spec = WorkerSpec(model_path=small_llama, load_format="dummy", kv_cache_bytes=lambda _: 0, quantization="int4")
    with pytest.raises(ConfigError, match="not a QAIC format"):
        QaicBackend.create(spec.with_dtype_for("qaic"), device="cpu")
