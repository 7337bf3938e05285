"""The model registry over HTTP: upload_and_convert, list, get, versions, configure.

Routes take POST with a JSON body, as the seed product's management API does. The upload is
multipart: a `metadata` JSON part and a `file` part (a GGUF file, or a zip of a Hugging Face
model directory). Starlette spools the file part to disk past 1 MiB; from there it is streamed to
the Object Store in chunks and hashed on the way, so no model is ever held in memory whole.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import zipfile

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.openai.body import decode_json, read_json
from services.api.openai.defaults import openai_defaults_from
from shared.config import ConfigError
from shared.control.arrow_schema import INPUTS, OUTPUTS, fields_of
from shared.control.deploy_config import (
    ContinuousBatchingConfig,
    FrameworkConfig,
    OpenaiConfig,
    check_name,
    check_qaic_framework,
    convert,
    parse_accel,
    visibility,
    workspace_id,
)
from shared.control.registry import ModelVersion, PipelineStep
from shared.models.architectures import servable_error
from shared.models.custom_artifact import scripts_in
from shared.models.custom_environment import python_for
from shared.models.gguf_fields import is_gguf
from shared.models.model_files import artifact_root, cache_root, inspect_artifact, model_in, unpacked
from shared.wire.lora import peft_lora_rank

router = APIRouter(prefix="/v1/api/models")
MAX_METADATA_BYTES = 1 << 20
FRAMEWORKS = ("vllm", "custom")  # a custom model's own Python runs beside the engine (services/custom_runtime)
_CONVERTING: set[asyncio.Task] = set()  # background conversions, held until they finish
SINGLE_BATCH_ERROR = ("Continuous batching is not supported with single batch mode. Please update the model "
                      "configuration or contact your Switchyard operator for support")  # the product's text, whole


def registry_of(request: Request):
    ctx: ApiContext = request.app.state.ctx
    if ctx.pipelines.registry is None:
        raise APIError(503, "the model registry (NATS JetStream) is not available")
    return ctx, ctx.pipelines.registry


def as_json(record) -> dict:
    return msgspec.to_builtins(record)


def config_error(exc: ConfigError) -> APIError:
    return APIError(400, str(exc), code="invalid_config")


@router.post("/upload_and_convert")
async def upload_and_convert(request: Request) -> JSONResponse:
    _, registry = registry_of(request)
    form = await request.form(max_files=1, max_fields=8, max_part_size=MAX_METADATA_BYTES)
    try:
        metadata, upload = form.get("metadata"), form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "the upload needs a `file` part with the model", param="file")
        if not isinstance(metadata, str):
            raise APIError(400, "the upload needs a `metadata` part (JSON)", param="metadata")
        record, convert_wait = _new_version(metadata, os.path.basename(upload.filename or "model.gguf"))
        if record.lora_base is not None:
            await _check_lora_base(registry, record)
        record = await registry.create_version(record)
        try:
            record.sha256, record.size = await registry.put_artifact(record.object_name, upload.file)
            if convert_wait:
                await _inspect(upload, record)
                record.status = "ready"
            else:  # stored; converted in the background, from the Object Store (the SDK's convert_wait=False)
                record.status = "converting"
        except Exception as exc:  # whatever is wrong with the file, the version says so: never left 'uploading'
            _failed(record, exc)
        await registry.put_version(record)
    finally:
        await form.close()
    if record.status == "converting":  # after its record is stored, on a copy: the answer says "converting"
        task = asyncio.get_running_loop().create_task(_convert_later(registry, msgspec.structs.replace(record)))
        _CONVERTING.add(task)
        task.add_done_callback(_CONVERTING.discard)
    if record.status == "error":
        raise APIError(400, f"model {record.name!r} version {record.version}: {record.error}", param="file")
    return JSONResponse({"model": as_json(record)})


def _failed(record: ModelVersion, exc: Exception) -> None:
    record.status, record.error = "error", str(exc) if isinstance(exc, ValueError | OSError) \
        else f"{type(exc).__name__}: {exc}"


async def _convert_later(registry, record: ModelVersion) -> None:
    """converting -> ready, or error with the reason, whatever happens."""
    try:
        await asyncio.to_thread(_inspect_file, await registry.fetch_artifact(record, cache_root()), record)
        record.status = "ready"
    except Exception as exc:
        _failed(record, exc)
    await registry.put_version(record)


def _new_version(metadata: str, file_name: str) -> tuple[ModelVersion, bool]:
    meta = decode_json(metadata, "metadata", param="metadata")
    if not isinstance(meta, dict):
        raise APIError(400, "metadata must be a JSON object", param="metadata")
    conversion = meta.get("conversion") or {}
    try:
        if not isinstance(conversion, dict):
            raise ConfigError(f"conversion must be an object, got {type(conversion).__name__}")
        if not isinstance(conversion.get("framework_config") or {}, dict):
            raise ConfigError("conversion.framework_config must be an object")
        name = check_name("model", meta.get("name"))
        framework = conversion.get("framework", "vllm")
        if framework not in FRAMEWORKS:
            raise ConfigError(f"conversion.framework = {framework!r} is not allowed: allowed 'vllm' or 'custom'")
        accel = parse_accel(conversion.get("accel", "cpu"))
        fc = conversion.get("framework_config") or {}
        if fc.get("framework", framework) != framework:
            raise ConfigError(f"framework_config.framework = {fc.get('framework')!r} is not allowed: allowed "
                              f"{framework!r} (conversion.framework)")
        framework_config = convert(fc.get("config") or {}, FrameworkConfig, "framework_config").validate(accel.kind)
        if accel.qaic is not None:
            check_qaic_framework(framework_config, accel.qaic)
        workspace = workspace_id(meta.get("workspace_id"))
        shown_to = visibility(meta.get("visibility", "private"))
        schemas = {"input_schema": meta.get("input_schema"), "output_schema": meta.get("output_schema")}
        check_schemas(schemas, framework)
        lora_base = _lora_base(meta.get("lora_base"), framework)
        if conversion.get("requirements"):
            raise ConfigError(f"conversion.requirements = {conversion['requirements']!r} is not supported: a vLLM "
                              "model runs in the server's own pinned environment, and a custom model's "
                              "requirements are its zip's requirements.txt; send []")
    except ConfigError as exc:
        raise config_error(exc) from None
    convert_wait = meta.get("convert_wait", True)
    if not isinstance(convert_wait, bool):
        raise APIError(400, f"convert_wait must be true or false, got {convert_wait!r}", param="convert_wait")
    return ModelVersion(name=name, version=0, file_name=file_name, sha256="", size=0, status="uploading",
                        created_at=time.time(), framework=framework, framework_config=framework_config,
                        accel=accel, visibility=shown_to,
                        workspace_id=workspace, python_version=conversion.get("python_version"),
                        lora_base=lora_base, **schemas), \
        convert_wait


def _lora_base(raw, framework: str) -> PipelineStep | None:
    """metadata.lora_base: {name, version} of the model version a LoRA adapter upload adapts."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or type(raw.get("version")) is not int:
        raise ConfigError(f"lora_base must be {{\"name\": <model>, \"version\": <int>}}, got {raw!r}")
    if framework != "vllm":
        raise ConfigError(f"a LoRA adapter is served by the engine (framework 'vllm'), not {framework!r}")
    return PipelineStep(raw["name"], raw["version"])


async def _check_lora_base(registry, record: ModelVersion) -> None:
    base = await registry.version(record.lora_base.model, record.lora_base.version)
    if base is None:
        raise APIError(404, f"lora_base: model {record.lora_base.model!r} version {record.lora_base.version} does "
                       "not exist", param="lora_base", code="model_not_found")
    if base.status != "ready" or base.framework != "vllm" or base.lora_base is not None:
        raise APIError(400, f"lora_base: model {base.name!r} version {base.version} is not a ready vllm base model "
                       f"(status {base.status!r}, framework {base.framework!r})", param="lora_base")
    record.framework_config, record.accel = base.framework_config, base.accel  # it runs as its base does


def check_schemas(schemas: dict, framework: str) -> None:
    """input_schema / output_schema: base64 Arrow schemas of what the records route reads and writes
    (a custom model's columns are its script's own)."""
    for key, allowed in (("input_schema", INPUTS), ("output_schema", OUTPUTS)):
        if schemas.get(key) is not None and not isinstance(schemas[key], str):
            raise ConfigError(f"{key} must be a base64 Arrow schema (a string), got {type(schemas[key]).__name__}")
        fields_of(key, schemas.get(key), None if framework == "custom" else allowed)


async def _inspect(upload: UploadFile, record: ModelVersion) -> None:
    """Read what the model is from the spooled file; check max_model_len against its context."""
    suffix = ".zip" if record.file_name.endswith(".zip") else ".bin"
    with tempfile.TemporaryDirectory(prefix="switchyard-upload-") as folder:
        path = os.path.join(folder, "artifact" + suffix)
        await upload.seek(0)
        with open(path, "wb") as out:
            while chunk := await upload.read(1 << 20):
                out.write(chunk)
        await asyncio.to_thread(_inspect_file, path, record)


def _inspect_file(path, record: ModelVersion) -> None:
    """What the model is (an architecture the engine serves, for a vLLM-framework model), and its
    context checked; a custom model's zip also has its script found and its environment made (its
    requirements installed), so an upload that cannot run says so."""
    loadable = unpacked(str(path))
    if record.lora_base is not None:
        record.lora_rank = peft_lora_rank(loadable)
        record.architecture = "LoRA adapter"
        return
    if record.framework == "custom":
        if not zipfile.is_zipfile(path):
            raise ValueError("a custom model is a zip: its .py script, requirements.txt and model/")
        root = artifact_root(path)
        loadable = model_in(root)
        scripts_in(root)
        python_for(record.sha256, root)
    record.architecture, record.context_length = inspect_artifact(loadable)
    if record.framework != "custom" and (why := servable_error(record.architecture, is_gguf(loadable))):
        raise ValueError(why)
    _check_context(record)


def _check_context(record: ModelVersion) -> None:
    limit = record.framework_config.max_model_len
    if limit is not None and record.context_length and limit > record.context_length:
        raise ValueError(f"framework_config.max_model_len = {limit} is out of range: allowed 2 to "
                         f"{record.context_length} (the model's context length)")


@router.post("/list")
async def list_models(request: Request) -> JSONResponse:
    _, registry = registry_of(request)
    return JSONResponse({"models": [as_json(v) for v in await registry.models()]})


async def _named(request: Request) -> tuple[dict, str]:
    body = await read_json(request, MAX_METADATA_BYTES)
    name = body.get("name")
    if not isinstance(name, str):
        raise APIError(400, "name: a model name is required", param="name")
    try:
        return body, check_name("model", name)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="name") from None


async def _version(request: Request, registry) -> tuple[dict, ModelVersion]:
    """The version a body names (`name`, and `version` or the latest); 404 if there is none."""
    body, name = await _named(request)
    version = body.get("version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 1):
        raise APIError(400, f"version must be a version number (1, 2, ...) or null, got {version!r}", param="version")
    record = await registry.version(name, version)
    if record is None:
        raise APIError(404, f"model {name!r} (version {body.get('version') or 'latest'}) does not exist",
                       param="name", code="model_not_found")
    return body, record


@router.post("/get")
async def get_model(request: Request) -> JSONResponse:
    """The latest version (or `version`) of a model, with every version's number."""
    _, registry = registry_of(request)
    _, record = await _version(request, registry)
    name = record.name
    versions = [v.version for v in await registry.versions(name)]
    return JSONResponse({"model": as_json(record), "versions": versions})


@router.post("/versions")
async def model_versions(request: Request) -> JSONResponse:
    _, registry = registry_of(request)
    _, name = await _named(request)
    return JSONResponse({"versions": [as_json(v) for v in await registry.versions(name)]})


@router.post("/configure")
async def configure(request: Request) -> JSONResponse:
    """Continuous batching, OpenAI defaults and batch_config for one version (the latest if unnamed)."""
    _, registry = registry_of(request)
    body, record = await _version(request, registry)
    try:
        batch_config = body.get("batch_config")
        if batch_config not in (None, "single"):
            raise ConfigError(f"batch_config = {batch_config!r} is not allowed: allowed null or 'single'")
        cb = body.get("continuous_batching_config")
        if cb is not None and batch_config == "single":
            raise ConfigError(SINGLE_BATCH_ERROR)
        record.batch_config = batch_config
        record.continuous_batching_config = (
            convert(cb, ContinuousBatchingConfig, "continuous_batching_config").validate() if cb is not None else None)
        schemas = {k: body[k] for k in ("input_schema", "output_schema") if k in body}
        check_schemas(schemas, record.framework)
        for key, value in schemas.items():
            setattr(record, key, value)
        oc = body.get("openai_config")
        if oc is not None:
            openai_defaults_from(oc)  # every key a request field, every value one a request may carry
            record.openai_config = convert(oc, OpenaiConfig, "openai_config")
    except ConfigError as exc:
        raise config_error(exc) from None
    await registry.put_version(record)
    return JSONResponse({"model": as_json(record)})
