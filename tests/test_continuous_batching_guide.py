"""The product's continuous-batching guide, its code cells in order against a real stack: the
native vLLM runtime (SDK and MLOps API uploads, continuous batching at and after upload, deploy),
the custom vLLM runtime (the same, with the guide's builder in tests/custom_model), and publish.

Changed, and only these: the package name; the connection (this module's stack) and the model
(our SmolLM2 GGUF, zipped with the script for the custom runtime); the values of the variables the
guide leaves to its notebooks; the commas its cells miss; `sidekick_gpus(..., 1)` is 0 (no NVIDIA
GPU here: with one the guide's cell is refused by name, which is checked); and between its two
runtimes the pipeline is cleared, as each runtime's notebook starts from an empty one.
"""

from __future__ import annotations

import base64
import zipfile
from pathlib import Path

import httpx
import pyarrow as pa
import pytest

import switchyard
from switchyard.continuous_batching_config import ContinuousBatchingConfig
from switchyard.deployment_config import DeploymentConfigBuilder
from tests.oci_helpers import OciRegistry

pytestmark = pytest.mark.stack
API_KEY = "sk-guide"
# the guide's curl cells, their base64 schemas as printed there
GUIDE_INPUT_SCHEMA = ("/////7AAAAAQAAAAAAAKAAwABgAFAAgACgAAAAABBAAMAAAACAAIAAAABAAIAAAABAAAAAIAAABUAAAABAAAAMT///8AAAECEAAA"
                      "ACQAAAAEAAAAAAAAAAoAAABtYXhfdG9rZW5zAAAIAAwACAAHAAgAAAAAAAABQAAAABAAFAAIAAYABwAMAAAAEAAQAAAAAAABBRAA"
                      "AAAcAAAABAAAAAAAAAAGAAAAcHJvbXB0AAAEAAQABAAAAA==")
GUIDE_OUTPUT_SCHEMA = ("/////8AAAAAQAAAAAAAKAAwABgAFAAgACgAAAAABBAAMAAAACAAIAAAABAAIAAAABAAAAAIAAABcAAAABAAAALz///8AAAEC"
                       "EAAAACwAAAAEAAAAAAAAABEAAABudW1fb3V0cHV0X3Rva2VucwAAAAgADAAIAAcACAAAAAAAAAFAAAAAEAAUAAgABgAHAAwAAAAQ"
                       "ABAAAAAAAAEFEAAAACQAAAAEAAAAAAAAAA4AAABnZW5lcmF0ZWRfdGV4dAAABAAEAAQAAAA=")


@pytest.fixture(scope="module")
def guide_stack(tmp_path_factory):
    from tests.conftest import _start_stack

    registry = OciRegistry(tmp_path_factory.mktemp("guide-registry"))
    stack = _start_stack(tmp_path_factory, "guide", num_workers=1, extra_args=[
        "--api-key", API_KEY, "--agent-cpus", "8", "--agent-memory", "16Gi", "--engine-cpus", "4",
        "--label", "wallaroo.ai/accelerator:a100", "--oci-registry", f"http://{registry.host}/edge"])
    yield stack
    stack.stop()
    registry.stop()


def _curl_upload(stack, metadata: str, path: str) -> httpx.Response:
    """The guide's `curl -F 'metadata=...;type=application/json' -F file=@...`."""
    with open(path, "rb") as f:
        return httpx.post(f"{stack.base_url}/v1/api/models/upload_and_convert", timeout=300,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          files={"metadata": (None, metadata, "application/json"), "file": (Path(path).name, f)})


def test_the_guide_cell_by_cell(guide_stack, default_model_path, tmp_path):
    wl = switchyard.Client(guide_stack.base_url, api_key=API_KEY)
    model_name, model_file_name = "sample-vllm", default_model_path
    max_num_seqs, max_model_len, max_seq_len_to_capture = 16, 2048, 2048
    quantization, kv_cache_dtype, gpu_memory_utilization, block_size = None, "auto", 0.9, None

    # ---- Native vLLM runtime: upload via the SDK
    input_schema = pa.schema([
        pa.field('prompt', pa.string()),
        pa.field('max_tokens', pa.int64()),
    ])
    output_schema = pa.schema([
        pa.field('generated_text', pa.string()),
        pa.field('num_output_tokens', pa.int64())
    ])
    # (Optional) set the VLLMConfig values
    standard_framework_config = switchyard.framework.VLLMConfig(
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_seq_len_to_capture=max_seq_len_to_capture,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        block_size=block_size,
        device_group=None
    )
    # upload the vllm model with the framework configuration values
    vllm_model = wl.upload_model(model_name, \
                                  model_file_name, \
                                  framework=switchyard.framework.Framework.VLLM, \
                                  input_schema=input_schema, \
                                  output_schema=output_schema, \
                                  framework_config=standard_framework_config
                                )
    assert vllm_model.status == "ready"

    # ---- via the MLOps API: the schemas in base64, then the guide's curl
    assert base64.b64encode(bytes(input_schema.serialize())).decode("utf8") == GUIDE_INPUT_SCHEMA
    assert base64.b64encode(bytes(output_schema.serialize())).decode("utf8") == GUIDE_OUTPUT_SCHEMA
    metadata = ('{"name": "' + model_name + '", "visibility": "private", "workspace_id": 1, "conversion": '
                '{"framework": "vllm", "python_version": "3.8", "requirements": [], "framework_config": {"config": '
                '{"gpu_memory_utilization": 0.9, "max_model_len": 128}, "framework": "vllm"}}, "input_schema": "'
                + GUIDE_INPUT_SCHEMA + '", "output_schema": "' + GUIDE_OUTPUT_SCHEMA + '"}')
    uploaded = _curl_upload(guide_stack, metadata, model_file_name)
    assert uploaded.status_code == 200, uploaded.text
    # Retrieve the model
    vllm_model = wl.get_model(model_name)
    assert vllm_model.version == 2 and vllm_model.record["framework_config"]["max_model_len"] == 128

    # ---- Continuous batching: at upload, and after it
    max_concurrent_batch_size = 100
    continuous_batch_config = ContinuousBatchingConfig(max_concurrent_batch_size = max_concurrent_batch_size)
    vllm_model = wl.upload_model(model_name, \
                                  model_file_name, \
                                  framework=switchyard.framework.Framework.VLLM, \
                                  input_schema=input_schema, \
                                  output_schema=output_schema, \
                                  framework_config=standard_framework_config
                                ).configure(input_schema=input_schema, \
                                            output_schema=output_schema, \
                                            continuous_batch_config=continuous_batch_config \
                                           )
    vllm_model.configure(input_schema=input_schema, \
                         output_schema=output_schema, \
                         continuous_batch_config=continuous_batch_config \
                        )
    assert vllm_model.record["continuous_batching_config"] == {"max_concurrent_batch_size": 100, "speculative_config": None}

    # ---- Deploy: the guide's cell asks for an NVIDIA GPU, which this host does not have
    with pytest.raises(switchyard.SwitchyardError, match="sidekick_gpus = 1 is not allowed for accel .cpu."):
        wl.build_pipeline('gpu-pipeline').clear().add_model_step(vllm_model).deploy(
            deployment_config=DeploymentConfigBuilder().sidekick_gpus(vllm_model, 1).build())
    deployment_config = DeploymentConfigBuilder() \
        .cpus(1).memory('2Gi') \
        .sidekick_cpus(vllm_model, 8) \
        .sidekick_memory(vllm_model, '10Gi') \
        .sidekick_gpus(vllm_model, 0) \
        .deployment_label("wallaroo.ai/accelerator:a100") \
        .build()
    # create the pipeline
    vllm_pipeline = wl.build_pipeline('sample-vllm-pipeline')
    # add the LLM as a pipeline model step
    vllm_pipeline.add_model_step(vllm_model)
    vllm_pipeline.deploy(deployment_config=deployment_config)
    rows = vllm_pipeline.infer([{"prompt": "The capital of France is", "max_tokens": 6}])
    assert 1 <= rows[0]["num_output_tokens"] <= 6
    with pytest.raises(switchyard.SwitchyardError, match="Continuous batching is not supported with more than one "
                                                         "batch at a time, please send requests with a single batch"):
        vllm_pipeline.infer([{"prompt": "a", "max_tokens": 2}, {"prompt": "b", "max_tokens": 2}])

    # ---- Publish for edge
    published = vllm_pipeline.publish(deployment_config=deployment_config)
    assert published["status"] == "Published"
    vllm_pipeline.undeploy()
    vllm_pipeline.clear()  # the custom runtime's notebook starts from an empty pipeline

    # ---- Custom vLLM runtime: upload via the SDK (the zip: the guide's builder, requirements, the model)
    model_name, model_file_name = "sample-custom-vllm", str(tmp_path / "custom-vllm.zip")
    with zipfile.ZipFile(model_file_name, "w") as zf:
        for name in ("main.py", "requirements.txt"):
            zf.write(Path(__file__).parent / "custom_model" / name, name)
        zf.write(default_model_path, f"model/{Path(default_model_path).name}")
    # (Optional) set the framework configuration values
    custom_framework_config = switchyard.framework.CustomConfig(
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_seq_len_to_capture=max_seq_len_to_capture,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        block_size=block_size,
        device_group=None
    )
    # upload the vllm with the model configuration values
    custom_vllm_model = wl.upload_model(model_name,
                                  model_file_name,
                                  framework=switchyard.framework.Framework.CUSTOM,
                                  input_schema=input_schema,
                                  output_schema=output_schema,
                                  framework_config=custom_framework_config
                                  )
    assert custom_vllm_model.status == "ready"
    metadata = ('{"name": "' + model_name + '", "visibility": "private", "workspace_id": 1, "conversion": '
                '{"framework": "custom", "python_version": "3.8", "requirements": [], "framework_config": {"config": '
                '{"gpu_memory_utilization": 0.9, "max_model_len": 128}, "framework": "custom"}}, "input_schema": "'
                + GUIDE_INPUT_SCHEMA + '", "output_schema": "' + GUIDE_OUTPUT_SCHEMA + '"}')
    uploaded = _curl_upload(guide_stack, metadata, model_file_name)
    assert uploaded.status_code == 200, uploaded.text
    # Retrieve the model
    custom_vllm_model = wl.get_model(model_name)
    custom_vllm_model = wl.upload_model(model_name,
                                  model_file_name,
                                  framework=switchyard.framework.Framework.CUSTOM,
                                  input_schema=input_schema,
                                  output_schema=output_schema,
                                  framework_config=custom_framework_config
                                  ).configure(input_schema=input_schema,
                                             output_schema=output_schema,
                                             continuous_batch_config=continuous_batch_config
                                )
    custom_vllm_model.configure(input_schema=input_schema,
                                output_schema=output_schema,
                                continuous_batch_config=continuous_batch_config
                               )
    deployment_config = DeploymentConfigBuilder() \
        .cpus(1).memory('2Gi') \
        .sidekick_cpus(custom_vllm_model, 8) \
        .sidekick_memory(custom_vllm_model, '10Gi') \
        .sidekick_gpus(custom_vllm_model, 0) \
        .deployment_label("wallaroo.ai/accelerator:a100") \
        .build()
    # create the pipeline
    custom_vllm_pipeline = wl.build_pipeline('sample-vllm-pipeline')
    # add the LLM as a pipeline model step
    custom_vllm_pipeline.add_model_step(custom_vllm_model)
    vllm_pipeline.deploy(deployment_config=deployment_config)
    try:
        custom_rows = custom_vllm_pipeline.infer([{"prompt": "The capital of France is", "max_tokens": 6}])
        assert 1 <= custom_rows[0]["num_output_tokens"] <= 6 and isinstance(custom_rows[0]["generated_text"], str)
        with pytest.raises(switchyard.SwitchyardError, match="Continuous batching is not supported with more than"):
            custom_vllm_pipeline.infer([{"prompt": "a", "max_tokens": 2}, {"prompt": "b", "max_tokens": 2}])
        assert vllm_pipeline.publish(deployment_config=deployment_config)["status"] == "Published"
    finally:
        vllm_pipeline.undeploy()
    assert [p["status"] for p in vllm_pipeline.publishes()] == ["Published", "Published"]
