"""A pipeline of several model steps (the RAG pattern: an embedder, then the LLM): each step deploys
as a pipeline of its own, `<name>-step<i>`, which schedulers, agents and gateways serve as any
other; the parent deploys, undeploys and reports them together, and its inference URL routes
embeddings, scores and reranking to its first step and completions and chat to its last."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from services.api.context import ApiContext, ServedModel
from services.api.errors import APIError
from shared.config import ConfigError
from shared.control.deploy_config import DeploymentConfig
from shared.control.deployment import DeployedModel, load_deployed
from shared.control.registry import Pipeline, Registry

FIRST_STEP_ROUTES = ("embeddings", "score", "rerank")  # the embedder's; completions and chat: the last step's


def child_name(parent: str, index: int) -> str:
    return f"{parent}-step{index + 1}"


async def deploy_steps(registry: Registry, pipeline: Pipeline, config: DeploymentConfig,
                       check: Callable[[Registry, DeployedModel], Awaitable[None]]) -> None:
    """Every step checked as its own deployment first (its configs, and room for it), then each
    child written deployed, then the parent. ConfigError names the step that cannot run."""
    children = []
    for i, step in enumerate(pipeline.steps):
        child = await registry.create_pipeline(child_name(pipeline.name, i))
        if child.children or child.parent not in (None, pipeline.name):
            raise ConfigError(f"pipeline {child.name!r} exists and is not a step of {pipeline.name!r}")
        candidate = msgspec.structs.replace(child, steps=[step], deployment_config=config, parent=pipeline.name)
        try:
            deployed = await load_deployed(registry, candidate)
            deployed.engine_config()
            await check(registry, deployed)
        except ConfigError as exc:
            raise ConfigError(f"step {i + 1} ({step.model} v{step.version}): {exc}") from None
        children.append(candidate)
    await undeploy_steps(registry, pipeline, keep=len(children))  # steps removed since the last deploy
    for child in children:
        child.deployed = True
        child.generation += 1
        await registry.put_pipeline(child)
    pipeline.children = [c.name for c in children]


async def undeploy_steps(registry: Registry, pipeline: Pipeline, keep: int = 0) -> None:
    """The children past the first `keep` undeployed (all of them by default)."""
    for name in pipeline.children[keep:]:
        child = await registry.pipeline(name)
        if child is not None and child.deployed:
            child.deployed = False
            await registry.put_pipeline(child)
    if not keep:
        pipeline.children = []


def aggregate(pipeline: Pipeline, parts: list[dict]) -> dict:
    """The parent's status from its steps' own (each as pipelines/status reports one pipeline)."""
    states = [p["status"] for p in parts]
    if not pipeline.deployed:
        overall = "Undeployed"
    elif "Error" in states:
        overall = "Error"
    elif states and all(s == "Running" for s in states):
        overall = "Running"
    else:
        overall = "Starting"
    return {"status": overall, "deployment": pipeline.deployment, "generation": pipeline.generation,
            "details": [d for p in parts for d in p["details"]], "replicas": None,
            "engines": [e for p in parts for e in p["engines"]],
            "engine_lbs": next((p["engine_lbs"] for p in parts if p["engine_lbs"]), []),
            "sidekicks": [s for p in parts for s in p["sidekicks"]],
            "models": [m for p in parts for m in p["models"]],
            "steps": [{"pipeline": name, "deployment": p["deployment"], "status": p["status"]}
                      for name, p in zip(pipeline.children, parts, strict=True)]}


def step_model(ctx: ApiContext, deployment: str, pipeline: str, route: str) -> str | None:
    """The served model a parent's inference URL reaches for `route`, or None if `deployment` is no
    deployed parent of that name; 503 while its step is not served yet."""
    parent = ctx.pipelines.parents.get(deployment)
    if parent is None or parent[0] != pipeline:
        return None
    children = parent[1]
    wanted = children[0] if route in FIRST_STEP_ROUTES else children[-1]
    served: ServedModel | None = next((m for m in ctx.models.values() if m.pipeline == wanted), None)
    if served is None:
        raise APIError(503, f"pipeline {pipeline!r} is deployed but its step {wanted!r} is not ready yet",
                       code="model_not_ready")
    return served.name
