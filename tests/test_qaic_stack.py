"""QAIC through real services. The product's QAIC + OpenAI tutorial, cell by cell with its own SDK
names (only the package renamed): upload with its QaicConfig, VLLMConfig and empty Arrow schemas,
configure continuous batching and OpenAI, deploy with its sidekick resources (4 SoCs) and node
label, infer (chat and completion, plain and streamed,
through the SDK and the openai client), undeploy; on SmolLM2, and on a small random Llama with
Llama 3.1's architecture (rope scaling llama3, 4 query heads per KV head) saved by transformers.
And one model served by a paged worker and a QAIC worker at once: what fits the static shapes
goes to the slots, the rest to the paged worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import nats
import pyarrow as pa
import pytest

# the tutorial's imports, with only the package name changed
import switchyard
from shared.bus.client import BusClient
from shared.wire.messages import SamplingParams
from switchyard.continuous_batching_config import ContinuousBatchingConfig
from switchyard.deployment_config import DeploymentConfigBuilder
from switchyard.engine_config import Acceleration, QaicConfig
from switchyard.framework import Framework, VLLMConfig
from switchyard.object import EntityNotFoundError
from switchyard.openai_config import OpenaiConfig
from tests.bus_helpers import scheduler_stats

pytestmark = pytest.mark.stack
API_KEY = "sk-qaic-tutorial"


QAIC_WORKER = {"num_cores": 1, "full_batch_size": 2, "ctx_len": 128, "prefill_seq_len": 32}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_name):
    """The flag model on a paged worker (the stack's) and on a QAIC worker started beside it."""
    from tests.conftest import _start_stack
    from tests.test_two_workers import _wait_for_workers

    stack = _start_stack(tmp_path_factory, "qaic", num_workers=1, extra_args=[
        "--api-key", API_KEY, "--agent-cpus", "8", "--agent-memory", "16Gi", "--engine-cpus", "4"])
    log = open(stack.log_dir / "worker-qaic.log", "wb")  # noqa: SIM115 (closed below)
    qaic = subprocess.Popen([sys.executable, "-m", "services.worker", "--nats-url", stack.nats_url,
                             "--worker-id", "qaic-0", "--device", "qaic", "--qaic-config", json.dumps(QAIC_WORKER)],
                            env=stack._env("worker-qaic"), stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(_wait_for_workers(stack.admin_url, model_name, 2))
        yield stack
    finally:
        qaic.terminate()
        qaic.wait(30)
        log.close()
        stack.stop()


@pytest.fixture(scope="module")
def wl(stack):
    """`wallaroo.Client()` with no arguments: the endpoint and key from the environment."""
    saved = {k: os.environ.get(k) for k in ("SWITCHYARD_URL", "SWITCHYARD_API_KEY")}
    os.environ.update(SWITCHYARD_URL=stack.base_url, SWITCHYARD_API_KEY=API_KEY)
    try:
        return switchyard.Client()
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.update({key: value})


async def test_what_fits_the_static_shapes_goes_to_the_slots(stack, model_name, cpu_kernels):
    nc = await nats.connect(stack.admin_url)
    bus = BusClient(nc)
    await bus.start()
    try:
        async def served_by(num_prompt: int) -> tuple[str, int]:
            stream = await bus.submit(model_name, list(range(100, 100 + num_prompt)),
                                      SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            entries = [e async for e in stream.entries(timeout=120)]
            return stream.worker_id, sum(len(e.token_ids) for e in entries)

        short = await asyncio.gather(*(served_by(20) for _ in range(3)))
        # 28 tokens fit ctx_len 128: two take the slots, the third (every slot taken) the paged worker
        assert sorted(short) == [("qaic-0", 8), ("qaic-0", 8), ("worker-0", 8)]
        assert await served_by(200) == ("worker-0", 8)  # 208 do not fit the slots
        # the CPU worker on the defaults: float32 on the C kernels, the GGUF's blocks kept
        assert set((await scheduler_stats(nc, model_name)).devices) == {
            f"cpu (float32, gguf weights, C kernels ({cpu_kernels.variant}))", "qaic, emulated on cpu"}
    finally:
        await bus.stop()
        await nc.close()


@pytest.fixture(scope="module")
def llama31_small(tmp_path_factory, hf_tokenizer) -> str:
    """Llama 3.1 8B's config, made small; random weights; SmolLM2's tokenizer beside them."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(hf_tokenizer), hidden_size=256, intermediate_size=896, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})
    path = tmp_path_factory.mktemp("llama31-small") / "llama-31-8b"
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    hf_tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("which", ["smollm2", "llama31"])
def test_the_qaic_tutorial_end_to_end(wl, which, default_model_path, llama31_small):
    qaic_config = QaicConfig(num_devices=4, full_batch_size=16, ctx_len=256, prefill_seq_len=128,
                             mxfp6_matmul=True, mxint8_kv_cache=True)
    llm = wl.upload_model(
        "llama-qaic-openai", default_model_path if which == "smollm2" else llama31_small, framework=Framework.VLLM,
        framework_config=VLLMConfig(max_num_seqs=16, max_model_len=256, max_seq_len_to_capture=128,
                                    quantization="mxfp6", kv_cache_dtype="mxint8", gpu_memory_utilization=1),
        input_schema=pa.schema([]), output_schema=pa.schema([]),
        accel=Acceleration.QAIC.with_config(qaic_config))
    assert llm.status == "ready"
    llm = wl.get_model("llama-qaic-openai")
    assert llm.record["accel"]["qaic"] == {
        "num_cores": 16, "num_devices": 4, "ctx_len": 256, "prefill_seq_len": 128, "full_batch_size": 16,
        "mxfp6_matmul": True, "mxint8_kv_cache": True, "aic_enable_depth_first": False}
    cbc = ContinuousBatchingConfig(max_concurrent_batch_size=100)
    openai_config = OpenaiConfig(enabled=True, completion_config={"temperature": .3, "max_tokens": 200},
                                 chat_completion_config={"temperature": .3, "max_tokens": 200})
    llm = llm.configure(continuous_batch_config=cbc, openai_config=openai_config)
    # sidekick_gpus is the number of Qualcomm AI 100 SoCs
    deployment_config = DeploymentConfigBuilder().cpus(1).memory("1Gi").sidekick_cpus(llm, 4) \
        .sidekick_memory(llm, "12Gi").sidekick_gpus(llm, 4).deployment_label("kubernetes.io/os:linux").build()
    pipeline = wl.build_pipeline("llamaqaic-openai")
    pipeline.undeploy()
    pipeline.clear().add_model_step(llm)
    pipeline.deploy(deployment_config=deployment_config)
    try:
        status = pipeline.status()
        assert status["status"] == "Running"
        assert status["engines"][0]["info"]["devices"] == ["qaic, emulated on cpu"]

        reply = pipeline.openai_chat_completion(messages=[{"role": "user", "content": "good morning"}], max_tokens=24)
        assert reply.choices[0].message.content
        text = pipeline.openai_completion(prompt="tell me about wallaroo.AI", max_tokens=24).choices[0].text
        assert isinstance(text, str) and text
        streamed = [c.choices[0].delta.content or "" for c in pipeline.openai_chat_completion(
            messages=[{"role": "user", "content": "this is a short story about love"}], max_tokens=16, stream=True)
            if c.choices]
        assert "".join(streamed)
        chunks = list(pipeline.openai_completion(prompt="tell me about wallaroo.AI", max_tokens=16, stream=True,
                                                 extra_body={"ignore_eos": True}))
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1

        # the OpenAI client on the pipeline's endpoint, with the SDK's token
        openai = pytest.importorskip("openai")
        token = wl.auth.auth_header()["Authorization"].split()[1]
        assert token == API_KEY
        client = openai.OpenAI(base_url=f"{wl.api_endpoint}/v1", api_key=token, max_retries=0, timeout=120)
        out = client.completions.create(model=pipeline.deployment, prompt="tell me about wallaroo.AI",
                                        max_tokens=12, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 12
        too_long = httpx.post(f"{wl.api_endpoint}/v1/completions", headers={"Authorization": f"Bearer {token}"},
                              json={"model": pipeline.deployment, "prompt": "hello " * 100, "max_tokens": 200})
        assert too_long.status_code == 400 and "maximum context length is 256 tokens" in too_long.text
    finally:
        pipeline.undeploy()
    assert pipeline.status()["status"] == "Undeployed"
    with pytest.raises(EntityNotFoundError):
        wl.get_model("no-such-model")
