"""The deploy tests' stack, shared by this package's modules: its own nats-server (JetStream in a
folder the restart test reuses), an API key, fast scaling, a CPU budget that does not depend on the
machine, and an OCI registry for published pipelines."""

from __future__ import annotations

import pyarrow as pa
import pytest

from switchyard import Client
from switchyard.config import Acceleration, ContinuousBatchingConfig, FrameworkConfig, OpenaiConfig
from tests.deploy.helpers import API_KEY, TEMPLATE, start
from tests.oci_helpers import OciRegistry


@pytest.fixture(scope="package")
def store(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("deploy-nats"))


@pytest.fixture(scope="package")
def oci_registry(tmp_path_factory):
    registry = OciRegistry(tmp_path_factory.mktemp("oci-registry"))
    yield registry
    registry.stop()


@pytest.fixture(scope="package")
def stacks(tmp_path_factory, store, oci_registry):
    held = [start(tmp_path_factory, store, oci_registry)]  # the restart test replaces it
    yield held
    held[-1].stop()


@pytest.fixture
def wl(stacks) -> Client:
    return Client(stacks[-1].base_url, api_key=API_KEY)


@pytest.fixture(scope="package")
def smollm2(stacks, default_model_path):
    """The issue's own upload and configure."""
    wl = Client(stacks[-1].base_url, api_key=API_KEY)
    llm = wl.upload_model("smollm2", default_model_path, framework="vllm",
                          framework_config=FrameworkConfig(max_num_seqs=16, max_model_len=2048, block_size=16,
                                                           kv_cache_dtype="auto", gpu_memory_utilization=0.9),
                          accel=Acceleration.CPU,
                          # the continuous-batching guide's schemas for the records route
                          input_schema=pa.schema([pa.field("prompt", pa.string()), pa.field("max_tokens", pa.int64())]),
                          output_schema=pa.schema([pa.field("generated_text", pa.string()),
                                                   pa.field("num_output_tokens", pa.int64())]))
    return llm.configure(
        continuous_batching_config=ContinuousBatchingConfig(max_concurrent_batch_size=100),
        openai_config=OpenaiConfig(enabled=True, completion_config={"temperature": .3, "max_tokens": 200},
                                   chat_completion_config={"temperature": .3, "max_tokens": 200,
                                                           "chat_template": TEMPLATE}))
