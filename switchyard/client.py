"""The Python SDK: upload a model, configure it, build and deploy a pipeline, infer, undeploy.

    wl = Client("http://127.0.0.1:8000", api_key=...)
    llm = wl.upload_model("smollm2", "model.gguf", framework="vllm", framework_config=..., accel=...)
    llm = llm.configure(continuous_batching_config=..., openai_config=...)
    p = wl.build_pipeline("smol-pipe"); p.add_model_step(llm); p.deploy(deployment_config=cfg)
    p.openai_chat_completion(messages=[...]); p.undeploy()

Every call is the HTTP management API underneath (docs/deploy.md); inference goes through the
official `openai` client on the pipeline's inference URL.
"""

from __future__ import annotations

import os
import tempfile
import time
import zipfile

import httpx
import msgspec

from shared.control import arrow_schema
from shared.models import hub
from switchyard.config import Acceleration, AccelerationWithConfig, FrameworkConfig
from switchyard.inference_logs import either, inference_log_frame, unix_seconds

DEFAULT_ENDPOINT = "http://127.0.0.1:8000"  # `make run`'s


class SwitchyardError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class EntityNotFoundError(SwitchyardError):
    """A model, version or pipeline that does not exist (HTTP 404); `switchyard.object` exports it."""


class Auth:
    def __init__(self, api_key: str | None):
        self.api_key = api_key

    def auth_header(self) -> dict[str, str]:
        """The bearer header for the client's key (a server without keys takes any token)."""
        return {"Authorization": f"Bearer {self.api_key or 'none'}"}


class Client:
    def __init__(self, api_endpoint: str | None = None, api_key: str | None = None, timeout: float = 600.0):
        """With no arguments, the endpoint and key come from SWITCHYARD_URL and SWITCHYARD_API_KEY
        (default: `make run`'s address, no key)."""
        self.api_endpoint = (api_endpoint or os.environ.get("SWITCHYARD_URL") or DEFAULT_ENDPOINT).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("SWITCHYARD_API_KEY")
        self.auth = Auth(self.api_key)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.http = httpx.Client(base_url=self.api_endpoint, headers=headers, timeout=timeout)

    def _post(self, path: str, **kwargs) -> dict | list:
        response = self.http.post(path, **kwargs)
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise (EntityNotFoundError if response.status_code == 404 else SwitchyardError)(
                response.status_code, message)
        return response.json()

    # ---- models --------------------------------------------------------------------------------

    def upload_model(self, name: str, path: str, framework: str = "vllm",
                     framework_config: FrameworkConfig | None = None,
                     accel: Acceleration | AccelerationWithConfig = Acceleration.CPU,
                     input_schema=None, output_schema=None,
                     visibility: str = "private", workspace_id: int | None = None,
                     python_version: str | None = None, requirements: list[str] | None = None,
                     convert_wait: bool = True, lora_base: ModelVersion | None = None,
                     revision: str | None = None) -> ModelVersion:
        """A GGUF file, a Hugging Face model directory (zipped on the way) or a zip of one, or a Hub id:
        org/name (a checkpoint) or org/name:TAG (one GGUF), fetched here through huggingface_hub (its
        environment: HF_ENDPOINT, HF_TOKEN, HF_HOME) at `revision`, then uploaded.
        lora_base: `path` is a LoRA adapter (PEFT's directory) of that model version; it runs as its
        base does, and a pipeline with the base's step serves it by its own name (add_model_step).
        convert_wait=False returns once the file is stored, its status "converting"; `refresh()`
        shows it move to "ready" (or "error", with the reason)."""
        config = framework_config or FrameworkConfig()
        if hub.is_hub_id(path):
            path = hub.fetch(path, revision)
        metadata = {
            "name": name, "visibility": visibility, "workspace_id": workspace_id, "convert_wait": convert_wait,
            "lora_base": {"name": lora_base.name, "version": lora_base.version} if lora_base else None,
            "input_schema": arrow_schema.to_wire(input_schema), "output_schema": arrow_schema.to_wire(output_schema),
            "conversion": {"framework": framework, "accel": accel.to_wire(), "python_version": python_version,
                           "requirements": requirements or [],
                           "framework_config": {"framework": framework, "config": msgspec.to_builtins(config)}},
        }
        with _as_file(path) as (file_name, f):
            body = self._post("/v1/api/models/upload_and_convert",
                              data={"metadata": msgspec.json.encode(metadata).decode()},
                              files={"file": (file_name, f, "application/octet-stream")})
        return ModelVersion(self, body["model"])

    def get_model(self, name: str, version: int | None = None) -> ModelVersion:
        return ModelVersion(self, self._post("/v1/api/models/get", json={"name": name, "version": version})["model"])

    def list_models(self) -> list[ModelVersion]:
        return [ModelVersion(self, m) for m in self._post("/v1/api/models/list", json={})["models"]]

    def model_versions(self, name: str) -> list[ModelVersion]:
        return [ModelVersion(self, m) for m in self._post("/v1/api/models/versions", json={"name": name})["versions"]]

    # ---- pipelines -----------------------------------------------------------------------------

    def build_pipeline(self, name: str) -> Pipeline:
        return Pipeline(self, self._post("/v1/api/pipelines/create", json={"name": name})["pipeline"])

    def get_pipeline(self, name: str) -> Pipeline:
        return Pipeline(self, self._post("/v1/api/pipelines/get", json={"pipeline": name})["pipeline"])

    def list_pipelines(self) -> list[Pipeline]:
        return [Pipeline(self, p) for p in self._post("/v1/api/pipelines/list", json={})["pipelines"]]


class _as_file:
    """A path as (file name, open binary file); a directory is zipped to a temporary file first."""

    def __init__(self, path: str):
        self.path = path
        self.tmp = None

    def __enter__(self):
        path = self.path
        if os.path.isdir(path):
            self.tmp = tempfile.NamedTemporaryFile(suffix=".zip", delete=False)
            with zipfile.ZipFile(self.tmp, "w", zipfile.ZIP_STORED) as zf:
                for root, _, files in os.walk(path):
                    for f in files:
                        full = os.path.join(root, f)
                        zf.write(full, os.path.relpath(full, path))
            self.tmp.close()
            self.f = open(self.tmp.name, "rb")
            return os.path.basename(os.path.normpath(path)) + ".zip", self.f
        self.f = open(path, "rb")
        return os.path.basename(path), self.f

    def __exit__(self, *exc):
        self.f.close()
        if self.tmp is not None:
            os.unlink(self.tmp.name)


class ModelVersion:
    def __init__(self, client: Client, record: dict):
        self.client = client
        self.record = record

    name = property(lambda self: self.record["name"])
    version = property(lambda self: self.record["version"])
    sha = property(lambda self: self.record["sha256"])
    status = property(lambda self: self.record["status"])

    def configure(self, continuous_batching_config=None, openai_config=None, batch_config: str | None = None,
                  continuous_batch_config=None, input_schema=None, output_schema=None) -> ModelVersion:
        """Continuous batching, OpenAI defaults (a request's own values win), batch_config, and the
        records route's Arrow schemas (pyarrow Schemas or their base64; left as they are when not
        given). `continuous_batch_config` is the other spelling the product's docs use."""
        if continuous_batch_config is not None:
            if continuous_batching_config is not None:
                raise TypeError("configure() got both continuous_batching_config and continuous_batch_config")
            continuous_batching_config = continuous_batch_config
        body = {"name": self.name, "version": self.version, "batch_config": batch_config,
                "continuous_batching_config": msgspec.to_builtins(continuous_batching_config),
                "openai_config": msgspec.to_builtins(openai_config)}
        for key, schema in (("input_schema", input_schema), ("output_schema", output_schema)):
            if schema is not None:
                body[key] = arrow_schema.to_wire(schema)
        self.record = self.client._post("/v1/api/models/configure", json=body)["model"]
        return self

    def refresh(self) -> ModelVersion:
        """The version as the registry has it now (a conversion's progress, a configure elsewhere)."""
        self.record = self.client._post("/v1/api/models/get", json={"name": self.name, "version": self.version})["model"]
        return self

    def __repr__(self) -> str:
        return f"ModelVersion({self.name!r}, version={self.version}, status={self.status!r})"


class Pipeline:
    def __init__(self, client: Client, record: dict):
        self.client = client
        self.record = record

    name = property(lambda self: self.record["name"])
    deployment = property(lambda self: self.record["deployment"])

    def _call(self, action: str, **fields) -> dict:
        return self.client._post(f"/v1/api/pipelines/{action}", json={"pipeline": self.name, **fields})

    def add_model_step(self, model: ModelVersion) -> Pipeline:
        """A model step; a LoRA adapter (uploaded with lora_base) joins its base's step instead, served
        beside it under the adapter's name (a request's `model`)."""
        self.record = self._call("add_step", model=model.name, version=model.version)["pipeline"]
        return self

    def clear(self) -> Pipeline:
        self.record = self._call("clear_steps")["pipeline"]
        return self

    def deploy(self, deployment_config=None, wait_for_status: bool = True, timeout: float = 600.0) -> Pipeline:
        """Write the desired state; by default wait until the deployment runs (or fails)."""
        self.record = self._call("deploy", deployment_config=msgspec.to_builtins(deployment_config))["pipeline"]
        if wait_for_status:
            self.wait_for("Running", timeout)
        return self

    def undeploy(self, wait_for_status: bool = True, timeout: float = 120.0) -> Pipeline:
        self.record = self._call("undeploy")["pipeline"]
        if wait_for_status:
            self.wait_for("Undeployed", timeout)
        return self

    def status(self) -> dict:
        return self._call("status")

    def wait_for(self, wanted: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if status["status"] == wanted and (wanted != "Undeployed" or not status["sidekicks"]):
                return status
            if status["status"] == "Error":
                raise SwitchyardError(500, f"pipeline {self.name!r} failed to deploy: {status}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline {self.name!r} not {wanted} after {timeout}s: {status}")
            time.sleep(0.5)

    def publish(self, deployment_config=None) -> dict:
        """Pushes the pipeline (its model files, every config, the engine's version) to the OCI
        registry the server was started with; `switchyard serve --from <pipeline_url>` serves it."""
        return self._call("publish", deployment_config=msgspec.to_builtins(deployment_config))["publish"]

    def publishes(self) -> list[dict]:
        """Every publish of this pipeline, with its status and reference, oldest first."""
        return self._call("list_publishes")["publishes"]

    def logs(self, limit: int = 100, start=None, end=None, start_datetime=None, end_datetime=None):
        """The newest `limit` inference log records that finished in [start, end) (datetimes or
        Unix seconds; the product's start_datetime/end_datetime too), oldest first, as a pandas
        DataFrame: time, in.*, out.*, metadata.* (docs/deploy.md, "Inference logs")."""
        start, end = either(start, start_datetime, "start"), either(end, end_datetime, "end")
        body = self._call("get_logs", limit=limit, start=unix_seconds(start), end=unix_seconds(end))
        return inference_log_frame(body["logs"])

    def replay(self, log_id: str, model_version: int | None = None) -> dict:
        """Runs a logged request again (its prompt, sampling parameters, seed and stop strings) on the
        model version the pipeline serves now: {"changed", "reproducible", "logged", "replayed"}."""
        if isinstance(model_version, ModelVersion):
            model_version = model_version.version
        return self._call("replay", log_id=log_id, model_version=model_version)

    # ---- inference -----------------------------------------------------------------------------

    def url(self) -> str:
        return f"{self.client.api_endpoint}/v1/api/pipelines/infer/{self.deployment}/{self.name}"

    def openai_client(self):
        import openai

        return openai.OpenAI(base_url=self.url() + "/openai/v1", api_key=self.client.api_key or "none",
                             max_retries=0, timeout=self.client.http.timeout.read)

    def openai_completion(self, **kwargs):
        return self.openai_client().completions.create(model=self.deployment, **kwargs)

    def openai_chat_completion(self, **kwargs):
        return self.openai_client().chat.completions.create(model=self.deployment, **kwargs)

    def infer(self, records: list[dict] | dict) -> list[dict]:
        """The records route: [{"prompt", "max_tokens"}] -> [{"generated_text", "num_output_tokens"}]."""
        response = self.client.http.post(self.url(), json=records)
        if response.status_code >= 400:
            raise SwitchyardError(response.status_code, response.json()["error"]["message"])
        return response.json()
