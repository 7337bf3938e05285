"""Publish for edge: a pipeline, its model files and every config pushed to an OCI registry as one
artifact (shared/control/pipeline_artifact.py), which `switchyard serve --from <reference>` serves elsewhere."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.pipelines.routes_models import as_json, config_error
from services.api.pipelines.routes_pipelines import find_pipeline, read_body
from shared.config import ConfigError
from shared.control import pipeline_artifact
from shared.control.deploy_config import DeploymentConfig, convert
from shared.control.oci import OciError, Reference, Registry
from shared.control.registry import Publish
from shared.models.model_files import cache_root

router = APIRouter(prefix="/v1/api/pipelines")


def _target(configured: str | None, pipeline: str, tag: str) -> tuple[Reference, bool]:
    """--oci-registry's [scheme://]host[:port][/namespace] -> (host/namespace/pipeline:tag, plain http?)."""
    if not configured:
        raise APIError(400, "no OCI registry is configured: start the API with --oci-registry "
                       "(SY_OCI_REGISTRY), e.g. http://127.0.0.1:5000/switchyard", code="no_registry")
    url = urlsplit(configured if "://" in configured else "https://" + configured)
    namespace = url.path.strip("/")
    repository = f"{namespace}/{pipeline}" if namespace else pipeline
    return Reference.parse(f"{url.netloc}/{repository}:{tag}"), url.scheme == "http"


@router.post("/publish")
async def publish(request: Request) -> JSONResponse:
    """{"pipeline", "deployment_config"?}: pushes the pipeline as it is now (its steps' model
    versions and configs; the deployment config given, else the pipeline's own)."""
    body, registry = await read_body(request)
    pipeline = await find_pipeline(registry, body)
    ctx: ApiContext = request.app.state.ctx
    try:
        raw = body.get("deployment_config")
        config = convert(raw, DeploymentConfig, "deployment_config").validate() if raw \
            else pipeline.deployment_config or DeploymentConfig()
    except ConfigError as exc:
        raise config_error(exc) from None
    if not pipeline.steps:
        raise APIError(400, f"pipeline {pipeline.name!r} has no steps: add_model_step first", param="pipeline")
    versions = [await registry.version(step.model, step.version) for step in pipeline.steps]
    for step, version in zip(pipeline.steps, versions, strict=True):
        if version is None or version.status != "ready":
            raise APIError(409, f"model {step.model!r} version {step.version} is not ready "
                           f"({version.status if version else 'missing'})", param="pipeline")
    publish_id = len(pipeline.publishes) + 1
    ref, plain_http = _target(ctx.pipelines.oci_registry, pipeline.name, str(publish_id))
    now = time.time()
    record = Publish(id=publish_id, pipeline_name=pipeline.name, pipeline_version=pipeline.generation,
                     status="Published", created_at=now, updated_at=now, pipeline_url=str(ref),
                     engine_version=pipeline_artifact.engine_version(), deployment_config=config)
    artifact = {"engine_version": record.engine_version, "deployment_config": msgspec.to_builtins(config),
                "pipeline": {"name": pipeline.name, "steps": msgspec.to_builtins(pipeline.steps)},
                "models": [as_json(v) for v in versions]}
    try:
        files = [(await registry.fetch_artifact(v, cache_root()), v.object_name, f"sha256:{v.sha256}", v.size)
                 for v in versions]
        record.digest = await asyncio.to_thread(_push, ref, plain_http, artifact, files)
    except (OciError, OSError, ValueError) as exc:  # the registry refused or is away: the publish says so
        record.status, record.error = "Error", f"{type(exc).__name__}: {exc}"
    record.updated_at = time.time()
    pipeline = await find_pipeline(registry, body)  # as it is now: a deploy meanwhile is kept
    pipeline.publishes.append(record)
    await registry.put_pipeline(pipeline)
    if record.status == "Error":
        raise APIError(502, f"publishing {pipeline.name!r} to {ref} failed: {record.error}", code="publish_failed")
    return JSONResponse({"publish": as_json(record)})


def _push(ref: Reference, plain_http: bool, artifact: dict, files) -> str:
    with Registry(ref.host, plain_http=plain_http) as oci:
        return pipeline_artifact.push(oci, ref, artifact, files)


@router.post("/list_publishes")
async def list_publishes(request: Request) -> JSONResponse:
    body, registry = await read_body(request)
    pipeline = await find_pipeline(registry, body)
    return JSONResponse({"publishes": [as_json(p) for p in pipeline.publishes]})
