"""The seed product's workflow through the SDK against real services: upload, configure, build,
deploy, infer (OpenAI routes, records route), status, undeploy; two models at once, CPU beside QAIC;
replicas scaling; uploads of a Hugging Face directory and of a name again (conftest.py: the stack)."""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import pytest

from services.worker.backends.torch_cpu.kernels.load import load as load_kernels
from switchyard import SwitchyardError
from switchyard.config import (
    Acceleration,
    DeploymentConfigBuilder,
    FrameworkConfig,
    QaicConfig,
)
from switchyard.object import EntityNotFoundError
from tests.deploy.helpers import API_KEY, pid_alive

pytestmark = pytest.mark.stack


def test_sdk_workflow_end_to_end(wl, smollm2, stacks):
    assert smollm2.status == "ready" and smollm2.version >= 1 and len(smollm2.sha) == 64
    assert smollm2.record["architecture"] == "llama" and smollm2.record["context_length"] == 8192
    llm = smollm2
    cfg = DeploymentConfigBuilder().replicas(1, 2).cpus(1).memory("1Gi") \
        .sidekick_cpus(llm, 2).sidekick_memory(llm, "4Gi").sidekick_gpus(llm, 0).build()
    p = wl.build_pipeline("smol-pipe")
    p.add_model_step(llm)
    p.deploy(deployment_config=cfg)
    status = p.status()
    assert status["status"] == "Running"
    assert status["engines"][0]["info"]["num_workers"] == 1
    engine = status["engines"][0]  # the product's shape, as its tutorial prints it
    assert engine["pipeline_statuses"]["pipelines"] == [{"id": "smol-pipe", "status": "Running",
                                                          "version": str(status["generation"])}]
    assert engine["model_statuses"]["models"][0] == {
        "model_version_id": smollm2.version, "name": "smollm2", "sha": smollm2.sha, "status": "Running",
        "version": str(smollm2.version)}
    assert engine["ip"] and engine["reason"] is None
    assert [lb["status"] for lb in status["engine_lbs"]] == ["Running"] and status["engine_lbs"][0]["ip"]
    assert [m["name"] for m in status["models"]] == ["smollm2"]
    assert (status["replicas"]["min"], status["replicas"]["max"]) == (1, 2)
    sidekick = status["sidekicks"][0]
    assert sidekick["status"] in ("Starting", "Running") and pid_alive(sidekick["pid"])

    reply = p.openai_chat_completion(messages=[{"role": "user", "content": "good morning"}])
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens <= 200  # the configured max_tokens default applies
    chunks = list(p.openai_completion(prompt="tell me a story", max_tokens=8, stream=True,  # sampled: no early EOS
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks and all(c.usage is not None for c in chunks)  # usage on every chunk, as the seed does
    assert all(c.usage.ttft > 0 and c.usage.tps > 0 for c in chunks)
    assert chunks[-1].usage.completion_tokens == 8

    # the chat template from chat_completion_config is the one rendered (it opens the answer)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    tokenized = httpx.post(f"{wl.api_endpoint}/tokenize", headers=auth,
                           json={"model": "smol-pipe", "messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = httpx.post(f"{wl.api_endpoint}/detokenize", headers=auth,
                          json={"model": "smol-pipe", "tokens": tokenized["tokens"]}).json()["prompt"]
    assert rendered.endswith("<|im_start|>assistant\nSure. ")
    plain = httpx.post(f"{wl.api_endpoint}/v1/chat/completions", headers=auth,
                       json={"model": "smol-pipe", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 4}, timeout=60)
    assert plain.status_code == 200, plain.text  # the plain route, by pipeline name

    rows = p.infer([{"prompt": "The capital of France is", "max_tokens": 6}])
    # the configured temperature (0.3) samples, so the model may end early (EOS); never past the row's max_tokens
    assert 1 <= rows[0]["num_output_tokens"] <= 6 and isinstance(rows[0]["generated_text"], str)
    with pytest.raises(SwitchyardError, match="row 0: column 'temperature' is not in the model's input_schema"):
        p.infer([{"prompt": "a", "max_tokens": 2, "temperature": 0.5}])  # the schema says which columns exist
    assert smollm2.record["input_schema"].startswith("/////")  # stored as the HTTP API sends it: base64 IPC
    with pytest.raises(SwitchyardError, match="Continuous batching is not supported with more than one batch"):
        p.infer([{"prompt": "a", "max_tokens": 2}, {"prompt": "b", "max_tokens": 2}])

    # the inference log: every engine request served for the pipeline (refused ones never ran)
    greedy = p.openai_completion(prompt="The capital of France is", max_tokens=6, temperature=0)
    logs = p.logs()
    assert list(logs["metadata.route"]) == ["chat/completions", "completions", "chat/completions", "completions",
                                            "completions"]
    last = logs.iloc[-1]
    assert last["in.prompt"] == "The capital of France is" and last["out.generated_text"] == greedy.choices[0].text
    assert last["out.num_output_tokens"] == greedy.usage.completion_tokens and last["metadata.temperature"] == 0
    assert last["metadata.model_version"] == smollm2.version and last["metadata.ttft_s"] > 0
    assert logs.iloc[0]["in.messages"] == [{"role": "user", "content": "good morning"}]
    assert list(p.logs(limit=2)["metadata.log_id"]) == list(logs["metadata.log_id"].iloc[-2:])
    assert len(p.logs(start_datetime=last["time"].to_pydatetime())) == 1
    assert len(p.logs(end=last["time"].to_pydatetime())) == 4 and p.logs(start=time.time() + 60).empty
    replayed = p.replay(last["metadata.log_id"])  # greedy: the same tokens again
    assert replayed["reproducible"] and not replayed["changed"]
    assert replayed["replayed"]["output"] == greedy.choices[0].text
    with pytest.raises(SwitchyardError, match="model_version 99 is not the one pipeline 'smol-pipe' serves"):
        p.replay(last["metadata.log_id"], model_version=99)
    with pytest.raises(EntityNotFoundError):
        p.replay("0123abc")

    p.undeploy()
    assert p.status()["status"] == "Undeployed"
    deadline = time.monotonic() + 30
    while pid_alive(sidekick["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(sidekick["pid"])  # unloaded: the worker process is gone with its memory
    gone = httpx.post(f"{wl.api_endpoint}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "smol-pipe", "prompt": "x", "max_tokens": 2})
    assert gone.status_code == 404


def test_two_models_serve_at_once(wl, smollm2, default_model_path):
    small = wl.upload_model("smollm2-int8", default_model_path,
                            framework_config=FrameworkConfig(max_num_seqs=4, max_model_len=1024, quantization="int8"))
    cfg = lambda m: DeploymentConfigBuilder().sidekick_cpus(m, 1).sidekick_memory(m, "1Gi").build()  # noqa: E731
    a = wl.build_pipeline("pipe-a").clear().add_model_step(smollm2)
    b = wl.build_pipeline("pipe-b").clear().add_model_step(small)
    a.deploy(deployment_config=cfg(smollm2), wait_for_status=False)
    b.deploy(deployment_config=cfg(small))
    a.wait_for("Running", 300)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(p.openai_completion, prompt="Once upon a time", max_tokens=12,
                                   extra_body={"ignore_eos": True}) for p in (a, b, a, b)]
            results = [f.result() for f in futures]
        assert all(r.usage.completion_tokens == 12 for r in results)
        assert {r.model for r in results} == {a.deployment, b.deployment}
        long_prompt = "the cat sat on the mat and " * 150  # ~1,200 tokens
        with pytest.raises(Exception, match="maximum context length is 1024"):
            b.openai_completion(prompt=long_prompt, max_tokens=4)
        fits_in_a = a.openai_completion(prompt=long_prompt, max_tokens=4, extra_body={"ignore_eos": True})
        assert fits_in_a.usage.completion_tokens == 4  # a's limit is 2048
        assert a.status()["engines"][0]["name"] != b.status()["engines"][0]["name"]
    finally:
        a.undeploy()
        b.undeploy()


def test_qaic_and_cpu_deployments_serve_through_the_same_routes(wl, smollm2, default_model_path):
    """The tutorial's QAIC upload (its formats and shapes, smaller), emulated on this host's CPU
    beside a CPU deployment: the same OpenAI routes, the emulation shown where a user looks."""
    qaic = QaicConfig(num_cores=1, num_devices=1, full_batch_size=4, ctx_len=256, prefill_seq_len=64,
                      mxfp6_matmul=True, mxint8_kv_cache=True)
    llm = wl.upload_model("smollm2-qaic", default_model_path, framework_config=FrameworkConfig(
        max_num_seqs=4, max_model_len=256, quantization="mxfp6", kv_cache_dtype="mxint8"),
        accel=Acceleration.QAIC.with_config(qaic))
    cfg = lambda m, gpus: DeploymentConfigBuilder().sidekick_cpus(m, 1).sidekick_memory(m, "2Gi") \
        .sidekick_gpus(m, gpus)  # noqa: E731
    on_qaic = wl.build_pipeline("on-qaic").clear().add_model_step(llm)
    on_cpu = wl.build_pipeline("on-cpu").clear().add_model_step(smollm2)
    on_qaic.deploy(deployment_config=cfg(llm, 1).build(), wait_for_status=False)
    # the suite's stack runs --deterministic; this deployment's own field takes the fast path instead
    on_cpu.deploy(deployment_config=cfg(smollm2, 0).deterministic(False).build())
    on_qaic.wait_for("Running", 300)
    try:
        assert on_qaic.status()["engines"][0]["info"]["devices"] == ["qaic, emulated on cpu"]
        variant = load_kernels().variant  # the worker's: the same library, on the same CPU
        assert on_cpu.status()["engines"][0]["info"]["devices"] == [f"cpu (float32, gguf weights, C kernels ({variant}))"]
        auth = {"Authorization": f"Bearer {API_KEY}"}
        listed = {m["id"]: m for m in httpx.get(f"{wl.api_endpoint}/v1/models", headers=auth).json()["data"]}
        served = listed[on_qaic.deployment]
        assert served["devices"] == ["qaic, emulated on cpu"] and served["max_model_len"] == 256
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # six requests for four slots
            futures = [pool.submit(p.openai_completion, prompt=f"Story {i}: once upon a time", max_tokens=10,
                                   extra_body={"ignore_eos": True}) for i, p in enumerate([on_qaic] * 6 + [on_cpu])]
            results = [f.result() for f in futures]
        assert all(r.usage.completion_tokens == 10 for r in results)
        chunks = list(on_qaic.openai_chat_completion(messages=[{"role": "user", "content": "good morning"}],
                                                     max_tokens=8, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
        greedy = [on_qaic.openai_completion(prompt="The capital of France is", max_tokens=6, temperature=0).choices[0]
                  .text for _ in range(2)]
        assert greedy[0] == greedy[1]  # the static shapes run the same whatever fills the other slots
        with pytest.raises(Exception, match="maximum context length is 256 tokens"):
            on_qaic.openai_completion(prompt="the cat sat on the mat " * 40, max_tokens=100)
    finally:
        on_qaic.undeploy()
        on_cpu.undeploy()


def test_replicas_scale_up_under_load_and_down_when_idle(wl, default_model_path):
    one_at_a_time = wl.upload_model("smollm2-serial", default_model_path, framework_config=FrameworkConfig(
        max_num_seqs=1, max_model_len=512))
    p = wl.build_pipeline("scaled").clear().add_model_step(one_at_a_time)
    p.deploy(deployment_config=DeploymentConfigBuilder().replicas(1, 2).sidekick_cpus(one_at_a_time, 1)
             .sidekick_memory(one_at_a_time, "1Gi").build())
    try:
        counts = []
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(p.openai_completion, prompt="Count: one two", max_tokens=40,
                                   extra_body={"ignore_eos": True}) for _ in range(8)]
            while not all(f.done() for f in futures):
                counts.append(len(p.status()["sidekicks"]))
                time.sleep(0.5)
            assert all(f.result().usage.completion_tokens == 40 for f in futures)
        assert max(counts) == 2  # a deep queue added a replica, never past replicas_max
        deadline = time.monotonic() + 60
        while len(p.status()["sidekicks"]) > 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(p.status()["sidekicks"]) == 1  # idle: back down to replicas_min
    finally:
        p.undeploy()


def test_a_worker_that_cannot_start_is_an_error_and_its_model_answers_503(wl, smollm2):
    p = wl.build_pipeline("too-small").clear().add_model_step(smollm2)
    # 64 MiB: less than the weights even with the GGUF's blocks kept (the defaults)
    p.deploy(deployment_config=DeploymentConfigBuilder().sidekick_memory(smollm2, "64Mi").build(),
             wait_for_status=False)
    try:
        with pytest.raises(SwitchyardError, match="raise sidekick_memory"):
            p.wait_for("Running", 120)
        reply = httpx.post(f"{p.url()}/openai/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert reply.status_code == 503, reply.text
    finally:
        p.undeploy(wait_for_status=False)


def test_a_hugging_face_directory_uploads_zipped_and_serves(wl, tmp_path, hf_tokenizer):
    """A tiny random Llama in transformers' own format, with SmolLM2's tokenizer beside it."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(hf_tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny", safe_serialization=True)
    hf_tokenizer.save_pretrained(tmp_path / "tiny")
    tiny = wl.upload_model("tiny-llama", str(tmp_path / "tiny"))
    assert tiny.record["file_name"] == "tiny.zip"
    assert (tiny.record["architecture"], tiny.record["context_length"]) == ("LlamaForCausalLM", 512)
    p = wl.build_pipeline("tiny").clear().add_model_step(tiny)
    p.deploy(deployment_config=DeploymentConfigBuilder().sidekick_memory(tiny, "256Mi").build())
    try:
        out = p.openai_completion(prompt="Hello there", max_tokens=5, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
    finally:
        p.undeploy()


def test_convert_wait_false_returns_at_once_and_the_status_moves_on(wl, default_model_path, tmp_path):
    def settled(model, timeout_s=120):
        deadline = time.monotonic() + timeout_s
        while model.refresh().status == "converting":
            assert time.monotonic() < deadline, "the conversion never finished"
            time.sleep(0.2)
        return model

    later = wl.upload_model("converted-later", default_model_path, convert_wait=False)
    assert later.status == "converting"
    assert settled(later).status == "ready" and later.record["architecture"] == "llama"
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + bytes(40))  # a header that promises what the file lacks
    broken = wl.upload_model("broken-later", str(fake), convert_wait=False)
    assert broken.status == "converting"
    assert settled(broken).status == "error" and "GGUF file cannot be read" in broken.record["error"]


def test_uploading_a_name_again_makes_a_new_version(wl, smollm2, default_model_path):
    again = wl.upload_model("smollm2", default_model_path)
    versions = wl.model_versions("smollm2")
    assert again.version == versions[-1].version > smollm2.version
    assert {v.sha for v in versions} == {smollm2.sha}
    assert all(v.record["file_name"] == os.path.basename(default_model_path) for v in versions)
