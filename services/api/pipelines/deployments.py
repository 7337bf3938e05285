"""The API's view of deployments: a ServedModel per deployed pipeline, kept in step with the registry.

When a pipeline is deployed the gateway fetches its artifact (for the tokenizer and chat
template), applies the model's OpenAI config, and serves it under the deployment's name, the
pipeline's name and the model's name. Until that is done, requests for it get 503; after undeploy,
404.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from services.api.context import ApiContext, ServedModel
from services.api.openai.defaults import OpenaiDefaults, openai_defaults_from
from shared.control.deployment import load_deployed
from shared.control.registry import Pipeline
from shared.log import get_logger
from shared.models.tokenizer import load_tokenizer

log = get_logger("api")


class DeploymentWatcher:
    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        self._task: asyncio.Task | None = None
        self._generations: dict[str, int] = {}  # pipeline -> generation served (or being loaded)

    def start(self) -> None:
        self._task = asyncio.create_task(self.ctx.pipelines.registry.follow_pipelines(self._apply))

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    async def _apply(self, name: str, pipeline: Pipeline | None) -> None:
        parents = self.ctx.pipelines.parents
        for deployment in [d for d, (parent, _) in parents.items() if parent == name]:
            parents.pop(deployment)
        if pipeline is not None and pipeline.deployed and pipeline.children:  # its steps serve (steps.py)
            parents[pipeline.deployment] = (pipeline.name, list(pipeline.children))
        if pipeline is not None and pipeline.serves:
            if self._generations.get(name) == pipeline.generation:
                return
            self._remove(name)
            self._generations[name] = pipeline.generation
            self.ctx.pipelines.pending[pipeline.deployment] = pipeline.name
            self.ctx.pipelines.aliases[name] = pipeline.deployment
            for step in pipeline.steps[:1]:
                self.ctx.pipelines.aliases.setdefault(step.model, pipeline.deployment)
            asyncio.create_task(self._load(pipeline))
        elif name in self._generations:
            self._remove(name)

    def _remove(self, name: str) -> None:
        self._generations.pop(name, None)
        gone = {d for d, p in self.ctx.pipelines.pending.items() if p == name}
        gone |= {m.name for m in self.ctx.models.values() if m.pipeline == name}
        for deployment in gone:
            self.ctx.pipelines.pending.pop(deployment, None)
            if self.ctx.models.pop(deployment, None) is not None:
                log.info("deployment_removed", model=deployment)
        for alias, target in list(self.ctx.pipelines.aliases.items()):
            if target in gone:
                self.ctx.pipelines.aliases.pop(alias)

    async def _load(self, pipeline: Pipeline) -> None:
        try:
            deployed = await load_deployed(self.ctx.pipelines.registry, pipeline)
            path = await self.ctx.pipelines.registry.model_path(deployed.version)
            tokenizer = await asyncio.to_thread(load_tokenizer, path)
            oc = deployed.version.openai_config
            openai = openai_defaults_from(msgspec.to_builtins(oc)) if oc else OpenaiDefaults()
            served = ServedModel(
                name=pipeline.deployment, tokenizer=tokenizer, created=int(time.time()), openai=openai,
                pipeline=pipeline.name, deployed=deployed)
        except Exception as exc:  # noqa: BLE001 - logged; the deployment stays 503 until redeployed
            log.error("deployment_load_failed", pipeline=pipeline.name, error=f"{type(exc).__name__}: {exc}")
            return
        if self._generations.get(pipeline.name) != pipeline.generation:
            return  # undeployed or redeployed while loading
        self.ctx.pipelines.pending.pop(pipeline.deployment, None)
        self.ctx.models[served.name] = served
        await self.ctx.limits.refresh(served.name)  # its limits, if its scheduler published them before
        log.info("deployment_served", model=served.name, pipeline=pipeline.name)
