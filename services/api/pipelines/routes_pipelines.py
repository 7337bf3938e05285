"""Pipelines over HTTP: create, add_step, deploy, undeploy, status, list, get.

Deploy and undeploy only write the desired state into the registry (a pipeline's `deployed` flag
and `generation`); schedulers, API gateways and worker agents watch it and converge. Status reads
what they report back: the engine (the deployment's scheduler queue) over the bus, the sidekicks
(worker processes) from the agents' entries.
"""

from __future__ import annotations

import contextlib

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.api.errors import APIError
from services.api.openai.body import read_json
from services.api.pipelines.routes_models import as_json, config_error, registry_of
from services.api.pipelines.steps import aggregate, deploy_steps, undeploy_steps
from shared.config import ConfigError
from shared.control.agents import ENGINE_HOST, fits, free_resources, host_accepts, host_address, needs
from shared.control.deploy_config import DeploymentConfig, check_name, convert
from shared.control.deployment import load_deployed
from shared.control.registry import Pipeline, PipelineStep, Registry
from shared.wire import subjects
from shared.wire.messages import encode
from shared.wire.stats import SCHEDULER_STATS_DECODER, SchedulerStatsRequest

router = APIRouter(prefix="/v1/api/pipelines")


async def read_body(request: Request) -> tuple[dict, Registry]:
    _, registry = registry_of(request)
    return await read_json(request, 1 << 20), registry


async def find_pipeline(registry: Registry, body: dict) -> Pipeline:
    name = body.get("pipeline") or body.get("name")
    if not isinstance(name, str):
        raise APIError(400, "pipeline: a pipeline name is required", param="pipeline")
    try:
        check_name("pipeline", name)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="pipeline") from None
    pipeline = await registry.pipeline(name)
    if pipeline is None:
        raise APIError(404, f"pipeline {name!r} does not exist", param="pipeline", code="pipeline_not_found")
    return pipeline


def _described(pipeline: Pipeline) -> dict:
    return {"pipeline": {**as_json(pipeline), "deployment": pipeline.deployment}}


@router.post("/create")
async def create(request: Request) -> JSONResponse:
    body, registry = await read_body(request)
    try:
        name = check_name("pipeline", body.get("name"))
    except ConfigError as exc:
        raise config_error(exc) from None
    return JSONResponse(_described(await registry.create_pipeline(name)))


@router.post("/add_step")
async def add_step(request: Request) -> JSONResponse:
    """Append a model step (a version; the latest if none is named). Takes effect at the next deploy."""
    body, registry = await read_body(request)
    pipeline = await find_pipeline(registry, body)
    model, version = body.get("model"), body.get("version")
    record = await registry.version(model, version) if isinstance(model, str) else None
    if record is None:
        raise APIError(404, f"model {model!r} (version {version or 'latest'}) does not exist", param="model",
                       code="model_not_found")
    if record.lora_base is not None:  # an adapter: served beside its base's step, by its own name
        if record.lora_base not in pipeline.steps:
            raise APIError(400, f"model {record.name!r} is a LoRA adapter of {record.lora_base.model!r} version "
                           f"{record.lora_base.version}: add that model's step to the pipeline first", param="model")
        if all(a.model != record.name for a in pipeline.loras):
            pipeline.loras.append(PipelineStep(record.name, record.version))
    else:
        pipeline.steps.append(PipelineStep(record.name, record.version))
    await registry.put_pipeline(pipeline)
    return JSONResponse(_described(pipeline))


@router.post("/clear_steps")
async def clear_steps(request: Request) -> JSONResponse:
    body, registry = await read_body(request)
    pipeline = await find_pipeline(registry, body)
    pipeline.steps, pipeline.loras = [], []
    await registry.put_pipeline(pipeline)
    return JSONResponse(_described(pipeline))


@router.post("/deploy")
async def deploy(request: Request) -> JSONResponse:
    body, registry = await read_body(request)
    pipeline = await find_pipeline(registry, body)
    if pipeline.parent is not None:
        raise APIError(400, f"pipeline {pipeline.name!r} is a step of {pipeline.parent!r}: deploy that one",
                       param="pipeline")
    try:
        raw = body.get("deployment_config")
        config = convert(raw, DeploymentConfig, "deployment_config").validate() if raw else DeploymentConfig()
        if len(pipeline.steps) > 1:  # each step its own deployment (steps.py)
            await deploy_steps(registry, pipeline, config, _check_placement)
        else:
            candidate = msgspec.structs.replace(pipeline, deployment_config=config)
            deployed = await load_deployed(registry, candidate)
            deployed.engine_config()  # the model's configs are checked again as the engine will take them
            await _check_placement(registry, deployed)
            await undeploy_steps(registry, pipeline)  # the steps of an earlier deploy of several
    except ConfigError as exc:
        raise config_error(exc) from None
    pipeline.deployment_config, pipeline.deployed = config, True
    pipeline.generation += 1
    await registry.put_pipeline(pipeline)
    return JSONResponse(_described(pipeline))


async def _check_placement(registry: Registry, deployed) -> None:
    """The scheduler must have room for the engine, and some live worker host must offer the
    accelerator and have room for the minimum replicas."""
    records = await registry.agent_records()
    others = [p for p in await registry.pipelines() if p.serves and p.name != deployed.pipeline.name]
    engines = []
    for other in others:
        with contextlib.suppress(ConfigError):
            engines.append((await load_deployed(registry, other)).engine_resources())
    for scheduler in [r for r in records if r.accel == ENGINE_HOST]:
        if (why := fits(free_resources(scheduler, engines), deployed.engine_resources())) is not None:
            raise ConfigError(f"the scheduler has no room for the engine (deployment_config.cpus/memory): it {why}")
    agents = [r for r in records if r.accel != ENGINE_HOST]
    if not agents:
        raise ConfigError("no worker host (agent) is running, so nothing could serve the deployment")
    reasons = []
    for agent in agents:
        if (why := host_accepts(agent, deployed)) is not None:
            reasons.append(why)
            continue
        reserved = []
        for other in others:
            if any(w.deployment == other.deployment for w in agent.workers):
                try:
                    reserved.append(needs(await load_deployed(registry, other), other.deployment_config.replicas_min))
                except ConfigError:
                    continue
        why = fits(free_resources(agent, reserved), needs(deployed, deployed.deployment_config.replicas_min))
        if why is None:
            return
        reasons.append(f"host {agent.agent_id} {why}")
    raise ConfigError("no worker host can run the deployment: " + "; ".join(reasons))


@router.post("/undeploy")
async def undeploy(request: Request) -> JSONResponse:
    body, registry = await read_body(request)
    pipeline = await find_pipeline(registry, body)
    pipeline.deployed = False
    await undeploy_steps(registry, pipeline)
    await registry.put_pipeline(pipeline)
    return JSONResponse(_described(pipeline))


@router.post("/list")
async def list_pipelines(request: Request) -> JSONResponse:
    _, registry = await read_body(request)
    return JSONResponse({"pipelines": [_described(p)["pipeline"] for p in await registry.pipelines()]})


@router.post("/get")
async def get(request: Request) -> JSONResponse:
    body, registry = await read_body(request)
    return JSONResponse(_described(await find_pipeline(registry, body)))


@router.post("/status")
async def status(request: Request) -> JSONResponse:
    """The seed product's pipeline.status(): overall status, engines (with their pipeline and model
    statuses), engine_lbs (the gateway), sidekicks (the workers); plus replicas and models."""
    body, registry = await read_body(request)
    pipeline = await find_pipeline(registry, body)
    ctx = request.app.state.ctx
    if pipeline.children:
        children = [await registry.pipeline(name) for name in pipeline.children]
        return JSONResponse(aggregate(pipeline, [await _status(ctx, registry, c) for c in children if c is not None]))
    return JSONResponse(await _status(ctx, registry, pipeline))


async def _status(ctx, registry: Registry, pipeline: Pipeline) -> dict:
    agents = await registry.agent_records()
    workers = [w for a in agents for w in a.workers
               if w.deployment == pipeline.deployment and w.generation == pipeline.generation]
    refusals = [a.refused[pipeline.name] for a in agents if pipeline.name in a.refused]
    engine = None
    if pipeline.deployed:
        try:
            msg = await ctx.nc.request(subjects.scheduler_stats(pipeline.deployment),
                                       encode(SchedulerStatsRequest()), timeout=1.0)
            engine = SCHEDULER_STATS_DECODER.decode(msg.data)
        except Exception:
            engine = None
    ready = engine is not None and engine.num_workers > 0
    served = ctx.models.get(pipeline.deployment)
    if not pipeline.deployed:
        overall = "Undeployed"
    elif ready and served is not None:
        overall = "Running"
    elif any(w.state == "failed" for w in workers) or (refusals and not workers):
        overall = "Error"
    else:
        overall = "Starting"
    steps = [(step, await registry.version(step.model, step.version)) for step in pipeline.steps]
    model_status = overall if pipeline.deployed else "Undeployed"
    models = [{"name": step.model, "version": step.version, "status": model_status} for step, _ in steps]
    engines = [] if engine is None else [{  # the product's shape, and what only this build knows in "info"
        "ip": next((a.ip for a in agents if a.accel == ENGINE_HOST and a.ip), ""),
        "name": f"engine-{pipeline.deployment}", "status": "Running" if ready else "Starting", "reason": None,
        "details": refusals,
        "pipeline_statuses": {"pipelines": [{"id": pipeline.name, "status": overall,
                                             "version": str(pipeline.generation)}]},
        "model_statuses": {"models": [{"model_version_id": step.version, "name": step.model,
                                       "sha": record.sha256 if record else "", "status": model_status,
                                       "version": str(step.version)} for step, record in steps]},
        "info": {"num_workers": engine.num_workers, "num_running": engine.num_running,
                 "num_waiting": engine.num_waiting, "kv_cache_usage": engine.kv_cache_usage,
                 "devices": engine.devices}}]
    engine_lbs = [{"ip": host_address(), "name": f"engine-lb-{ctx.bus.client_id}", "status": "Running",
                   "reason": None, "details": []}] if pipeline.deployed else []  # the gateway answering
    host_of = {w.worker_id: a.ip for a in agents for w in a.workers}
    sidekicks = [{"ip": host_of.get(w.worker_id, ""), "name": w.worker_id, "pid": w.pid,
                  "status": w.state.capitalize(), "reason": w.error, "details": []} for w in workers]
    config = pipeline.deployment_config
    replicas = {"min": config.replicas_min, "max": config.replicas_max,
                "running": sum(w.state == "running" for w in workers)} if config else None
    return {"status": overall, "deployment": pipeline.deployment, "generation": pipeline.generation,
            "details": refusals, "replicas": replicas, "engines": engines, "engine_lbs": engine_lbs,
            "sidekicks": sidekicks, "models": models}
