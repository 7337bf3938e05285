"""Framework.CUSTOM: the product's custom vLLM runtime script, unchanged, in its own process and
environment (its requirements installed from the package index), its engine Switchyard's own."""

from __future__ import annotations

import concurrent.futures
import zipfile
from pathlib import Path

import httpx
import pyarrow as pa
import pytest

from switchyard import Client, SwitchyardError
from switchyard.continuous_batching_config import ContinuousBatchingConfig
from switchyard.deployment_config import DeploymentConfigBuilder
from switchyard.framework import CustomConfig, Framework

pytestmark = pytest.mark.stack
SCRIPT = Path(__file__).parent / "custom_model"
INPUT = pa.schema([pa.field("prompt", pa.string()), pa.field("max_tokens", pa.int64())])
OUTPUT = pa.schema([pa.field("generated_text", pa.string()), pa.field("num_output_tokens", pa.int64())])


@pytest.fixture(scope="module")
def wl(tmp_path_factory):
    from tests.conftest import _start_stack

    stack = _start_stack(tmp_path_factory, "custom", num_workers=1, extra_args=["--agent-cpus", "8"])
    yield Client(stack.base_url)
    stack.stop()


def _zip(folder: Path, model: str, requirements: str | None = None) -> Path:
    path = folder / "custom-vllm.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.write(SCRIPT / "main.py", "main.py")
        zf.writestr("requirements.txt", requirements or (SCRIPT / "requirements.txt").read_text())
        zf.write(model, f"model/{Path(model).name}")
    return path


def test_the_guides_custom_runtime_serves_rows_through_the_engine(wl, default_model_path, tmp_path):
    artifact = _zip(tmp_path, default_model_path)
    custom_framework_config = CustomConfig(max_num_seqs=16, max_model_len=2048)
    continuous_batch_config = ContinuousBatchingConfig(max_concurrent_batch_size=100)
    custom_vllm_model = wl.upload_model("custom-smol", str(artifact), framework=Framework.CUSTOM,
                                        input_schema=INPUT, output_schema=OUTPUT,
                                        framework_config=custom_framework_config,
                                        ).configure(input_schema=INPUT, output_schema=OUTPUT,
                                                    continuous_batch_config=continuous_batch_config)
    assert custom_vllm_model.status == "ready" and custom_vllm_model.record["framework"] == "custom"
    pipeline = wl.build_pipeline("custom-pipe").clear().add_model_step(custom_vllm_model)
    pipeline.deploy(deployment_config=DeploymentConfigBuilder().sidekick_memory(custom_vllm_model, "2Gi").build())
    try:
        prompt = "The capital of France is"
        rows = pipeline.infer([{"prompt": prompt, "max_tokens": 8}])
        # the same engine through the OpenAI route, greedy: the script's generate() gave the same text
        direct = pipeline.openai_completion(prompt=prompt, max_tokens=8, temperature=0)
        assert rows == [{"generated_text": direct.choices[0].text,
                         "num_output_tokens": direct.usage.completion_tokens}]
        # many rows at once: each its own predict, awaited together (the engine batches them)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: pipeline.infer([{"prompt": f"Count to {i}:", "max_tokens": 6}]),
                                    range(8)))
        assert all(a[0]["num_output_tokens"] >= 1 for a in answers)
        # the user's code fails one request; the runtime answers the next
        with pytest.raises(SwitchyardError, match="custom model's predict failed: .*max_tokens"):
            pipeline.infer([{"prompt": prompt, "max_tokens": -1}])
        assert pipeline.infer([{"prompt": prompt, "max_tokens": 8}]) == rows
        with pytest.raises(SwitchyardError, match="Continuous batching is not supported with more than one batch"):
            pipeline.infer([{"prompt": "a", "max_tokens": 2}, {"prompt": "b", "max_tokens": 2}])
    finally:
        pipeline.undeploy()


def test_a_requirement_that_cannot_be_installed_is_refused_at_upload(wl, default_model_path, tmp_path):
    artifact = _zip(tmp_path, default_model_path, "vllm==0.6.6\nno-such-package-switchyard-test==9.9\n")
    with pytest.raises(SwitchyardError, match="requirements.txt: pip could not install"):
        wl.upload_model("custom-broken", str(artifact), framework=Framework.CUSTOM, input_schema=INPUT,
                        output_schema=OUTPUT)
    reply = httpx.post(f"{wl.api_endpoint}/v1/api/models/get", json={"name": "custom-broken"}).json()
    assert reply["model"]["status"] == "error"
