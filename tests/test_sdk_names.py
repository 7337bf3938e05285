"""The SDK imports as the product's notebooks import theirs, with only the package name changed."""

from __future__ import annotations

import switchyard
from switchyard.client import SwitchyardError
from switchyard.continuous_batching_config import ContinuousBatchingConfig
from switchyard.deployment_config import DeploymentConfigBuilder
from switchyard.engine_config import Acceleration, QaicConfig
from switchyard.framework import CustomConfig, Framework, VLLMConfig
from switchyard.object import EntityNotFoundError
from switchyard.openai_config import OpenaiConfig


def test_the_products_names_are_the_sdks_types():
    assert (Framework.VLLM, Framework.CUSTOM) == ("vllm", "custom")
    config = VLLMConfig(max_num_seqs=16, max_model_len=256, quantization="mxfp6", kv_cache_dtype="mxint8")
    assert config.validate("qaic") is config and CustomConfig is VLLMConfig
    assert Acceleration.QAIC.with_config(QaicConfig(ctx_len=256)).to_wire()["qaic"]["ctx_len"] == 256
    assert ContinuousBatchingConfig(max_concurrent_batch_size=100).validate().max_concurrent_batch_size == 100
    assert OpenaiConfig(enabled=True).enabled
    assert DeploymentConfigBuilder().sidekick_gpus("m", 4).build().sidekick("m").gpus == 4
    assert issubclass(EntityNotFoundError, SwitchyardError)


def test_a_client_with_no_arguments_reads_the_environment(monkeypatch):
    monkeypatch.delenv("SWITCHYARD_URL", raising=False)
    monkeypatch.delenv("SWITCHYARD_API_KEY", raising=False)
    wl = switchyard.Client()
    assert wl.api_endpoint == "http://127.0.0.1:8000" and wl.api_key is None  # make run's address
    monkeypatch.setenv("SWITCHYARD_URL", "http://sy.example:9000/")
    monkeypatch.setenv("SWITCHYARD_API_KEY", "sk-env")
    wl = switchyard.Client()
    assert wl.api_endpoint == "http://sy.example:9000" and wl.auth.auth_header() == {"Authorization": "Bearer sk-env"}
    assert wl.http.headers["Authorization"] == "Bearer sk-env"
    assert switchyard.Client("http://other:1", api_key="sk-arg").auth.auth_header()["Authorization"] == "Bearer sk-arg"

