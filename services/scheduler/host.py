"""One scheduler process, many models: the one its flags name, plus one per deployed pipeline.

Each model has its own SchedulerService (its own queue, pools and admission limits) on its own
subjects. The host watches the registry's pipelines: a deploy starts a SchedulerService with the
engine settings derived from the model's configs (`shared/deployment.py`); an undeploy drains it
and stops it; a redeploy (new generation) replaces it.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from services.scheduler.service import SchedulerService
from shared.config import ConfigError, EngineConfig
from shared.deployment import load_deployed
from shared.log import get_logger
from shared.registry import Pipeline, Registry

log = get_logger("scheduler")
UNDEPLOY_GRACE_S = 5.0  # in-flight requests of an undeployed pipeline get this long to finish


class SchedulerHost:
    def __init__(self, nc: Client, config: EngineConfig | None):
        self.nc = nc
        self.static = SchedulerService(nc, config) if config is not None else None
        self.deployed: dict[str, tuple[int, SchedulerService]] = {}  # pipeline -> (generation, service)
        self._watch: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    @property
    def services(self) -> list[SchedulerService]:
        return ([self.static] if self.static else []) + [s for _, s in self.deployed.values()]

    async def start(self) -> None:
        if self.static is not None:
            await self.static.start()
        registry = await Registry(self.nc).open()
        self._watch = asyncio.create_task(self._follow(registry))

    async def drain(self, grace_s: float) -> None:
        await asyncio.gather(*(s.drain(grace_s) for s in self.services))

    async def stop(self) -> None:
        if self._watch:
            self._watch.cancel()
        for service in self.services:
            await service.stop()

    async def _follow(self, registry: Registry) -> None:
        while True:
            try:
                async for name, pipeline in registry.watch_pipelines():
                    async with self._lock:
                        await self._apply(registry, name, pipeline)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("deployment_watch_failed")
                await asyncio.sleep(1.0)

    async def _apply(self, registry: Registry, name: str, pipeline: Pipeline | None) -> None:
        current = self.deployed.get(name)
        wanted = pipeline is not None and pipeline.deployed
        if current is not None and (not wanted or current[0] != pipeline.generation):
            _, service = self.deployed.pop(name)
            await service.drain(UNDEPLOY_GRACE_S)
            await service.stop()
            log.info("deployment_stopped", model=service.model)
        if not wanted or name in self.deployed:
            return
        try:
            config = (await load_deployed(registry, pipeline)).engine_config()
        except ConfigError as exc:
            log.error("deployment_refused", pipeline=name, error=str(exc))
            return
        service = SchedulerService(self.nc, config)
        await service.start()
        self.deployed[name] = (pipeline.generation, service)
        log.info("deployment_started", model=config.model, generation=pipeline.generation)
