"""Deploy refusals by name (framework, accelerator and requirements), seed errors, a registry that
survives a restart of every service, workspace ids, the README's snippet, and a pipeline published to
an OCI registry and served elsewhere. The stack (conftest.py) is test_end_to_end.py's too, whose
tests must run first (the file sorts first): the README's snippet reuses its pipeline's name."""

from __future__ import annotations

import json
import os

import httpx
import msgspec
import pytest

from switchyard import Client, SwitchyardError
from switchyard.config import (
    Acceleration,
    ContinuousBatchingConfig,
    DeploymentConfigBuilder,
    OpenaiConfig,
)
from tests.deploy.helpers import API_KEY, start

pytestmark = pytest.mark.stack


@pytest.mark.parametrize(("config", "message"), [
    ({"max_num_seqs": 0}, "framework_config.max_num_seqs = 0 is out of range: allowed 1 to 1024"),
    ({"gpu_memory_utilization": 1.5}, "framework_config.gpu_memory_utilization = 1.5 is out of range"),
    ({"block_size": 12}, "framework_config.block_size = 12 is not allowed: allowed 8, 16, 32, 64 or 128"),
    ({"kv_cache_dtype": "fp8"}, "framework_config.kv_cache_dtype = 'fp8' is not supported"),
    ({"quantization": "fp8"}, "framework_config.quantization = 'fp8' is not supported"),
    ({"max_seq_len_to_capture": 0}, "framework_config.max_seq_len_to_capture = 0 is out of range"),
    ({"device_group": "Bad Group"}, "device_group name 'Bad Group' is not allowed"),
    ({"max_model_len": 9000}, "framework_config.max_model_len = 9000 is out of range: allowed 2 to 8192"),
    ({"max_num_seqs": "many"}, "framework_config: Expected `int`"),
    ({"unknown_field": 1}, "unknown field `unknown_field`"),
])
def test_upload_refuses_a_value_out_of_range_by_name(wl, default_model_path, config, message):
    metadata = {"name": "bad", "conversion": {"framework": "vllm", "accel": "cpu",
                                              "framework_config": {"framework": "vllm", "config": config}}}
    with open(default_model_path, "rb") as f:
        reply = httpx.post(f"{wl.api_endpoint}/v1/api/models/upload_and_convert",
                           headers={"Authorization": f"Bearer {API_KEY}"},
                           data={"metadata": json.dumps(metadata)}, files={"file": ("m.gguf", f)},
                           timeout=120)
    assert reply.status_code == 400
    assert message in reply.json()["error"]["message"]


@pytest.mark.parametrize(("accel", "message"), [
    ({"qaic": {"num_cores": 32}}, "accel.qaic.num_cores = 32 is out of range: allowed 1 to 16"),
    ({"qaic": {"ctx_len": 64, "prefill_seq_len": 128}}, "accel.qaic.prefill_seq_len = 128 is out of range"),
    ({"qaic": {"mxfp6_matmul": "yes"}}, "accel.qaic: Expected `bool`"),
    ("tpu", "accel = 'tpu' is not allowed"),
])
def test_upload_refuses_a_bad_accelerator_config(wl, accel, message):
    metadata = {"name": "bad", "conversion": {"accel": accel}}
    reply = httpx.post(f"{wl.api_endpoint}/v1/api/models/upload_and_convert",
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       data={"metadata": json.dumps(metadata)}, files={"file": ("m.gguf", b"GGUF")})
    assert reply.status_code == 400 and message in reply.json()["error"]["message"]


def test_upload_refuses_requirements_it_would_not_install(wl):
    metadata = {"name": "bad", "conversion": {"accel": "cpu", "requirements": ["vllm==0.6.0"]}}
    reply = httpx.post(f"{wl.api_endpoint}/v1/api/models/upload_and_convert",
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       data={"metadata": json.dumps(metadata)}, files={"file": ("m.gguf", b"GGUF")})
    assert reply.status_code == 400 and "conversion.requirements" in reply.json()["error"]["message"]


def test_seed_errors_and_refusals_at_configure_and_deploy(wl, smollm2, default_model_path):
    whole = ("^400: Continuous batching is not supported with single batch mode. Please update the model "
             "configuration or contact your Switchyard operator for support$")
    with pytest.raises(SwitchyardError, match=whole):
        wl.get_model("smollm2", smollm2.version).configure(
            batch_config="single", continuous_batching_config=ContinuousBatchingConfig(max_concurrent_batch_size=4))
    with pytest.raises(SwitchyardError, match="max_concurrent_batch_size = 0 is out of range"):
        wl.get_model("smollm2", smollm2.version).configure(
            continuous_batching_config=ContinuousBatchingConfig(max_concurrent_batch_size=0))
    with pytest.raises(SwitchyardError, match="completion_config has keys that are not request fields"):
        wl.get_model("smollm2", smollm2.version).configure(openai_config=OpenaiConfig(completion_config={"x": 1}))
    p = wl.build_pipeline("refused").clear().add_model_step(smollm2)
    with pytest.raises(SwitchyardError, match="replicas_max = 1 is out of range: allowed 3 to 16"):
        p.deploy(deployment_config=DeploymentConfigBuilder().replicas(3, 1).build())
    with pytest.raises(SwitchyardError, match="sidekick_gpus = 1 is not allowed for accel 'cpu'"):
        p.deploy(deployment_config=DeploymentConfigBuilder().sidekick_gpus(smollm2, 1).build())
    with pytest.raises(SwitchyardError, match="needs 64 CPUs, 8 free"):
        p.deploy(deployment_config=DeploymentConfigBuilder().sidekick_cpus(smollm2, 64).build())
    with pytest.raises(SwitchyardError, match="scheduler has no room for the engine .* needs 64 CPUs"):
        p.deploy(deployment_config=DeploymentConfigBuilder().cpus(64).build())
    with pytest.raises(SwitchyardError, match="memory = '4 gigs' is not a memory quantity"):
        p.deploy(deployment_config=DeploymentConfigBuilder().memory("4 gigs").build())
    cuda = wl.upload_model("on-cuda", default_model_path, accel=Acceleration.CUDA)
    with pytest.raises(SwitchyardError, match="offers accel 'cpu' and 'qaic', the model needs 'cuda'"):
        wl.build_pipeline("on-cuda").add_model_step(cuda).deploy()
    with pytest.raises(SwitchyardError, match="^404: pipeline 'nope' does not exist"):
        wl.get_pipeline("nope")
    reply = httpx.post(f"{wl.api_endpoint}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "refused", "prompt": "x"})
    assert reply.status_code == 404  # built, never deployed


def test_the_registry_survives_a_restart_of_every_service(stacks, tmp_path_factory, store, smollm2, oci_registry):
    wl = Client(stacks[-1].base_url, api_key=API_KEY)
    p = wl.build_pipeline("survivor").clear().add_model_step(smollm2)
    p.deploy(deployment_config=DeploymentConfigBuilder().sidekick_memory(smollm2, "1Gi").build())
    stacks[-1].stop()  # every service and nats-server itself
    stacks.append(start(tmp_path_factory, store, oci_registry))
    wl = Client(stacks[-1].base_url, api_key=API_KEY)
    assert "smollm2" in [m.name for m in wl.list_models()]
    p = wl.get_pipeline("survivor")
    p.wait_for("Running", 300)  # still deployed: the agent starts its worker again
    assert p.openai_completion(prompt="Hello", max_tokens=3).usage.completion_tokens == 3
    p.undeploy()


def test_workspace_id_as_the_docs_type_it_and_a_bad_record_never_breaks_listing(wl, stacks, default_model_path):
    """The product's docs type workspace_id as a string ("6"): it was stored as given into an integer
    field, and every listing after it failed to read that record."""
    import asyncio

    import nats

    def upload(name: str, **meta):
        with open(default_model_path, "rb") as f:
            return httpx.post(f"{wl.api_endpoint}/v1/api/models/upload_and_convert",
                              headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                              data={"metadata": json.dumps({"name": name, **meta})}, files={"file": ("m.gguf", f)})

    reply = upload("in-workspace", workspace_id="6", visibility="public")
    assert reply.status_code == 200 and reply.json()["model"]["workspace_id"] == 6
    for meta, message in (({"workspace_id": "six"}, "workspace_id = 'six' is not allowed"),
                          ({"visibility": "secret"}, "visibility = 'secret' is not allowed")):
        refused = upload("refused", **meta)
        assert refused.status_code == 400 and message in refused.json()["error"]["message"]

    async def write_a_bad_record() -> None:  # as an older build, or another client of the bus, could have
        nc = await nats.connect(stacks[-1].admin_url)
        kv = await nc.jetstream().key_value("sy-registry")
        await kv.put("models.broken.1", b'{"name": "broken", "version": 1, "workspace_id": "6"}')
        await nc.close()

    asyncio.run(write_a_bad_record())
    listed = httpx.post(f"{wl.api_endpoint}/v1/api/models/list", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={}, timeout=30)
    assert listed.status_code == 200
    names = {m["name"] for m in listed.json()["models"]}
    assert "in-workspace" in names and "broken" not in names


def test_the_readmes_sdk_snippet_runs_outside_make_and_again(stacks, tmp_path):
    """Word for word, by the venv's python from another folder with no PYTHONPATH, twice (the same
    pipeline again: its steps are cleared, not appended)."""
    import re
    import subprocess
    import sys

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    snippet = re.search(r"### Deploy your own models \(SDK\)\n\n```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "snippet.py").write_text(snippet)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SWITCHYARD_URL=stacks[-1].base_url, SWITCHYARD_API_KEY=API_KEY)
    for _ in range(2):
        run = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "out.generated_text" in run.stdout  # the log's DataFrame, after the completion's text


def test_a_published_pipeline_is_served_elsewhere_from_the_registry(wl, smollm2, oci_registry, tmp_path):
    """publish pushes an OCI artifact to a real registry; `switchyard serve --from` in another
    process, with its own bus, store and cache, pulls it and serves the same pipeline and configs."""
    import signal
    import subprocess
    import sys
    import threading

    from switchyard.nats_server import free_port

    p = wl.build_pipeline("edge-pipe").clear().add_model_step(smollm2)
    cfg = DeploymentConfigBuilder().sidekick_memory(smollm2, "1Gi").build()
    published = p.publish(deployment_config=cfg)
    assert published["status"] == "Published" and published["digest"].startswith("sha256:")
    assert published["pipeline_url"] == f"{oci_registry.host}/switchyard/edge-pipe:1"
    assert p.publishes() == [published]

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NATS_URL")}
    env.update(SY_NATS_STORE_DIR=str(tmp_path / "nats"), SWITCHYARD_CACHE=str(tmp_path / "cache"))
    serve = subprocess.Popen([sys.executable, "-m", "switchyard", "serve", "--from", published["pipeline_url"],
                              "--plain-http", "--port", str(port), "--kv-cache-memory-gib", "0.4", "--threads", "1"],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, serve.kill)  # a serve that never says it serves ends the wait
    watchdog.start()
    try:
        said = []
        for line in serve.stdout:  # its own line says the pipeline serves (or the output ends: it died)
            said.append(line)
            if line.startswith("[serve] serving pipeline"):
                break
        watchdog.cancel()
        assert said and said[-1].startswith("[serve] serving pipeline"), "".join(said)[-3000:]
        threading.Thread(target=serve.stdout.read, daemon=True).start()  # the rest drained, never blocking it
        there = Client(f"http://127.0.0.1:{port}")
        copy = there.get_pipeline("edge-pipe")
        assert copy.record["deployment_config"] == msgspec.to_builtins(cfg)
        (model,) = there.list_models()
        for field in ("name", "sha256", "framework_config", "accel", "continuous_batching_config", "openai_config",
                      "input_schema", "output_schema"):
            assert model.record[field] == smollm2.record[field], field
        reply = copy.openai_completion(prompt="The capital of France is", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert reply.choices[0].text and reply.usage.completion_tokens == 4
    finally:
        serve.send_signal(signal.SIGTERM)  # the launcher drains and stops its services
        serve.wait(60)


def test_upload_takes_every_family_and_refuses_an_architecture_it_cannot_serve(wl, tmp_path):
    """Each architecture the engine serves is taken at upload (its config.json read, the architecture
    recorded); one it does not serve is refused there by name, not at deploy."""
    from shared.models.architectures import HF_ARCHITECTURES

    for arch in sorted(HF_ARCHITECTURES) + ["T5EncoderModel"]:
        folder = tmp_path / arch
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [arch], "max_position_embeddings": 4096}))
        if arch == "T5EncoderModel":
            with pytest.raises(SwitchyardError, match="architecture 'T5EncoderModel' is not supported; known: Bert"):
                wl.upload_model("t5", str(folder))
            continue
        version = wl.upload_model(f"family-{arch.lower().replace('_', '-')}", str(folder))
        assert (version.status, version.record["architecture"]) == ("ready", arch)
