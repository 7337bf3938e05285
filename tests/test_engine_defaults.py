"""`make run`'s defaults are the fast path on every CPU: float32 on the C kernels with the GGUF's own
blocks, each choice with its reason; `--deterministic` (or a deployment's field) gives torch's own ops."""

from __future__ import annotations

import re

import pytest

from shared.config import ConfigError, EngineConfig
from shared.control.deploy_config import DeploymentConfig
from shared.engine_defaults import pick

Q4_1_FILE = {"Q4_1": 210, "Q8_0": 1, "F32": 61}  # the default GGUF's tensor types
NOT_BUILT = "the C kernels are not built (make install builds them)"


def test_every_cpu_gets_float32_the_files_blocks_on_the_kernels_eagerly_and_multi_step():
    d = pick(Q4_1_FILE, kernels=None)
    assert (d.dtype.value, d.quantization.value, d.compile.value, d.num_scheduler_steps.value) == \
        ("float32", "gguf", False, 4)
    assert d.deterministic.value is False
    assert "210 Q4_1, 1 Q8_0" in d.quantization.reason and "quant_linear" in d.quantization.reason
    assert "--compile" in d.compile.reason and "bfloat16" in d.dtype.reason


def test_a_dense_file_keeps_its_floats():
    d = pick({}, kernels=None)
    assert (d.dtype.value, d.quantization.value, d.compile.value, d.num_scheduler_steps.value) == \
        ("float32", "none", False, 1)
    assert pick({"F16": 100, "BF16": 1}, kernels=None).quantization.value == "none"
    q4_k_m = pick({"Q4_K": 100, "Q6_K": 13, "F32": 40}, kernels=None).quantization  # k-quants are kept too
    assert q4_k_m.value == "gguf" and "100 Q4_K, 13 Q6_K" in q4_k_m.reason


def test_without_the_kernels_the_blocks_are_dequantized_and_steps_are_single():
    d = pick(Q4_1_FILE, kernels=NOT_BUILT)
    assert (d.quantization.value, d.compile.value, d.num_scheduler_steps.value) == ("none", False, 1)
    assert NOT_BUILT in d.quantization.reason


def test_explicit_values_are_kept():
    d = pick(Q4_1_FILE, kernels=None, dtype="bfloat16", quantization="w8a8", compile=True, num_scheduler_steps=2)
    assert (d.dtype.value, d.quantization.value, d.compile.value, d.num_scheduler_steps.value) == \
        ("bfloat16", "w8a8", True, 2)
    assert all(c.reason == "asked for" for c in (d.dtype, d.quantization, d.compile, d.num_scheduler_steps))


def test_deterministic_is_float32_dense_eager_and_refuses_what_would_break_it():
    d = pick(Q4_1_FILE, kernels=None, deterministic=True)
    assert (d.dtype.value, d.quantization.value, d.compile.value, d.num_scheduler_steps.value) == \
        ("float32", "none", False, 1)
    assert d.deterministic.value is True
    assert pick(Q4_1_FILE, kernels=None, deterministic=True, dtype="float32", quantization="none").dtype.value == \
        "float32"
    for wrong in ({"dtype": "bfloat16"}, {"quantization": "int4"}, {"compile": True}):
        with pytest.raises(ConfigError, match="--deterministic computes in float32"):
            pick(Q4_1_FILE, kernels=None, deterministic=True, **wrong)


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
    from switchyard.service_flags import engine_defaults_lines

    lines = engine_defaults_lines(["--no-deterministic"])
    assert [line.split()[0] for line in lines] == ["dtype", "quantization", "compile", "num_scheduler_steps",
                                                   "deterministic"]
    assert all(re.match(r"^\S+ \S+: \S", line) for line in lines)
    assert lines[1].startswith("quantization gguf:")  # make install built the kernels
    assert engine_defaults_lines(["--device", "qaic"]) == []
    refused = engine_defaults_lines(["--deterministic", "--dtype", "bfloat16"])
    assert len(refused) == 1 and "refuse" in refused[0]


def test_the_dtype_flags_help_says_what_auto_picks():
    """The help, the launcher's line and the worker's pick come from one place (shared/config.py)."""
    import argparse

    from shared.config import add_worker_args

    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    text = " ".join(next(a for a in parser._actions if a.dest == "dtype").help.split())
    assert f"auto: {pick(Q4_1_FILE, kernels=None).dtype.value} on the cpu backend, on every CPU" in text
    assert "AMX" not in text and "bfloat16 where" not in text


@pytest.mark.parametrize(("quantization", "expected"), [("auto", "gguf"), ("none", "none")])
def test_a_cuda_worker_keeps_a_ggufs_blocks_unless_told_none(default_model_path, monkeypatch, quantization, expected):
    """On --device cuda (no CPU defaults) auto keeps the file's own: a GGUF's blocks on the Triton GEMM, as
    a checkpoint's integers are kept (tests/kernels/test_quant_gemm.py runs them); none dequantizes."""
    import sys

    from services.worker.__main__ import parse_args, worker_spec
    from services.worker.settings import resolve

    monkeypatch.setattr(sys, "argv", ["worker", "--model-path", default_model_path, "--device", "cuda",
                                      "--quantization", quantization])
    assert worker_spec(resolve(parse_args())).quantization == expected
