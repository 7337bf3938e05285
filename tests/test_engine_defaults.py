"""`make run`'s defaults are the fast path on every CPU: picked from the CPU's features and the model
file, each with its reason; `--deterministic` (or a deployment's field) gives batch-invariant float32."""

from __future__ import annotations

import re

import httpx
import pytest

from shared.config import ConfigError, EngineConfig
from shared.cpu_features import cpu_flags, host_cpu_flags
from shared.deploy_config import DeploymentConfig
from shared.engine_defaults import pick

AVX512_BF16 = cpu_flags("flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16\n")
AMX = cpu_flags("flags\t\t: sse2 avx avx2 fma avx512f avx512_fp16 amx_bf16 amx_tile amx_int8\n")
AVX2 = cpu_flags("flags\t\t: sse2 avx avx2 fma f16c\n")
Q4_1_FILE = {"Q4_1": 210, "Q8_0": 1, "F32": 61}  # the default GGUF's tensor types


def test_avx512_bf16_gets_bfloat16_the_files_blocks_a_background_compile_and_multi_step():
    for flags in (AVX512_BF16, AMX):
        d = pick(flags, Q4_1_FILE, has_compiler=True)
        assert (d.dtype.value, d.quantization.value, d.compile.value, d.num_scheduler_steps.value) == \
            ("bfloat16", "gguf", True, 4)
        assert d.deterministic.value is False
    assert "avx512_bf16" in pick(AVX512_BF16, Q4_1_FILE).dtype.reason
    assert "amx_bf16" in pick(AMX, Q4_1_FILE).dtype.reason
    assert "210 Q4_1, 1 Q8_0" in pick(AVX512_BF16, Q4_1_FILE).quantization.reason


def test_avx2_keeps_float32_and_still_the_files_blocks_compiled():
    d = pick(AVX2, Q4_1_FILE, has_compiler=True)
    assert (d.dtype.value, d.quantization.value, d.compile.value, d.num_scheduler_steps.value) == \
        ("float32", "gguf", True, 4)
    assert "no AVX-512 BF16" in d.dtype.reason


def test_dense_float32_is_not_compiled_and_needs_no_multi_step():
    """A Hugging Face folder (no GGUF blocks) on AVX2: float32 Linears on oneDNN's packed weights."""
    d = pick(AVX2, {}, has_compiler=True)
    assert (d.dtype.value, d.quantization.value, d.compile.value, d.num_scheduler_steps.value) == \
        ("float32", "none", False, 1)
    assert "oneDNN" in d.compile.reason
    assert pick(AVX2, {"Q4_K": 100, "Q6_K": 1}).quantization.value == "none"  # k-quants are dequantized
    assert pick(AVX512_BF16, {}, has_compiler=True).compile.value is True  # bfloat16 dense compiles


def test_no_cpp_compiler_means_no_compile():
    d = pick(AVX512_BF16, Q4_1_FILE, has_compiler=False)
    assert d.compile.value is False and "g++" in d.compile.reason and d.num_scheduler_steps.value == 1


def test_explicit_values_are_kept():
    d = pick(AVX512_BF16, Q4_1_FILE, dtype="float32", quantization="w8a8", compile=False, num_scheduler_steps=2)
    assert (d.dtype.value, d.quantization.value, d.compile.value, d.num_scheduler_steps.value) == \
        ("float32", "w8a8", False, 2)
    assert all(c.reason == "asked for" for c in (d.dtype, d.quantization, d.compile, d.num_scheduler_steps))


def test_deterministic_is_float32_dense_eager_and_refuses_what_would_break_it():
    d = pick(AVX512_BF16, Q4_1_FILE, deterministic=True, has_compiler=True)
    assert (d.dtype.value, d.quantization.value, d.compile.value, d.num_scheduler_steps.value) == \
        ("float32", "none", False, 1)
    assert d.deterministic.value is True
    assert pick(AVX2, Q4_1_FILE, deterministic=True, dtype="float32", quantization="none").dtype.value == "float32"
    for wrong in ({"dtype": "bfloat16"}, {"quantization": "int4"}, {"compile": True}):
        with pytest.raises(ConfigError, match="--deterministic computes in float32"):
            pick(AVX512_BF16, Q4_1_FILE, deterministic=True, **wrong)


def test_auto_values_are_valid_engine_config_and_a_deployment_field():
    assert EngineConfig().quantization == "auto" and EngineConfig().num_scheduler_steps == 0
    EngineConfig().validate()
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=65).validate()
    assert DeploymentConfig(deterministic=True).validate().deterministic is True
    with pytest.raises(ConfigError, match="deployment_config.deterministic"):
        DeploymentConfig(deterministic="yes").validate()


def test_the_sdk_builder_sets_deterministic():
    from switchyard.deployment_config import DeploymentConfigBuilder

    assert DeploymentConfigBuilder().deterministic().build().deterministic is True
    assert DeploymentConfigBuilder().build().deterministic is None  # the stack's --deterministic


def test_the_launcher_prints_each_choice_with_its_reason():
    from switchyard.launcher import engine_defaults_lines

    lines = engine_defaults_lines(["--no-deterministic"])
    assert [line.split()[0] for line in lines] == ["dtype", "quantization", "compile", "num_scheduler_steps",
                                                   "deterministic"]
    assert all(re.match(r"^\S+ \S+: \S", line) for line in lines)
    assert engine_defaults_lines(["--device", "qaic"]) == []
    refused = engine_defaults_lines(["--deterministic", "--dtype", "bfloat16"])
    assert len(refused) == 1 and "refuse" in refused[0]


# ---- the defaults through the real services ------------------------------------------------------


@pytest.fixture(scope="module")
def fast_stack(tmp_path_factory):
    from tests.conftest import _start_stack

    s = _start_stack(tmp_path_factory, "fast-defaults", num_workers=1, extra_args=["--no-deterministic"])
    yield s
    s.stop()


def _wait_for_log(stack, text: str, timeout_s: float = 600) -> None:
    """The worker's log line, read as it is written (the compile is the event waited for)."""
    import time

    path = stack.log_dir / "worker-0.log"
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in {path}"
        time.sleep(0.5)


@pytest.mark.stack
def test_the_stack_serves_at_once_and_switches_to_compiled_steps(fast_stack, model_name):
    bf16 = any(f in host_cpu_flags() for f in ("avx512_bf16", "amx_bf16"))
    url = fast_stack.base_url
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert models[0]["devices"] == [f"cpu ({'bfloat16' if bf16 else 'float32'}, gguf weights, compiled decode, C decode attention, C row ops)"]
    body = {"model": model_name, "prompt": "The capital of France is", "max_tokens": 33, "temperature": 0,
            "ignore_eos": True}
    before = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()  # while it compiles
    assert before["usage"]["completion_tokens"] == 33
    _wait_for_log(fast_stack, "compiled_decode_ready")
    steps_before = _steps(url)
    after = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert after["usage"]["completion_tokens"] == 33
    assert after["choices"][0]["text"][:12] == before["choices"][0]["text"][:12]  # " Paris" and on, in both
    # the worker's pick of 4 decode iterations per Step reached the scheduler: 1 prefill + 32 tokens
    # in about 9 Steps, not 33
    assert _steps(url) - steps_before <= 12


def _steps(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("switchyard_scheduler_steps_total"))
