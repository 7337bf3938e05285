"""One scheduler process, many models: the one its flags name, plus one per deployed pipeline.

Each model has its own SchedulerService (its own queue, pools and admission limits) on its own
subjects. The host watches the registry's pipelines: a deploy starts a SchedulerService with the
engine settings derived from the model's configs (`shared/control/deployment.py`); an undeploy drains it
and stops it; a redeploy (new generation) replaces it. Each engine reserves its deployment's
`cpus`/`memory` from the host's budget (`--engine-cpus`, `--engine-memory`); one that does not fit
is not started, and the host's record in `sy-agents` says why (pipelines/status shows it).
With --leader-lease, the host first waits as a standby until it holds the lease (lease.py).
"""

from __future__ import annotations

import asyncio
import uuid

from nats.aio.client import Client

from services.scheduler.lease import Lease
from services.scheduler.service import SchedulerService
from shared.bus.liveness import SCHEDULER_HEARTBEAT_S
from shared.config import ConfigError, EngineConfig
from shared.control.agents import fits, free_resources
from shared.control.deployment import load_deployed
from shared.control.registry import AGENT_TTL_S, AgentRecord, Pipeline, Registry
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.messages import SchedulerHeartbeat, encode

log = get_logger("scheduler")
UNDEPLOY_GRACE_S = 5.0  # in-flight requests of an undeployed pipeline get this long to finish
REGISTRY_RETRY_S = 0.5


class SchedulerHost:
    def __init__(self, nc: Client, config: EngineConfig | None, budget: AgentRecord, lease: Lease | None = None):
        """lease: leadership among several scheduler processes (None: this one serves at once)."""
        self.nc = nc
        self.scheduler_id = uuid.uuid4().hex[:12]
        self.lease = lease
        self.static = SchedulerService(nc, config, self.scheduler_id) if config is not None else None
        self.deployed: dict[str, tuple[int, SchedulerService, tuple[float, int]]] = {}  # pipeline -> (gen, ...)
        self.budget = budget  # accel ENGINE_HOST; its `refused` names the pipelines that did not fit
        self.registry: Registry | None = None
        self._tasks: list[asyncio.Task] = []
        self._lock = asyncio.Lock()

    @property
    def services(self) -> list[SchedulerService]:
        return ([self.static] if self.static else []) + [s for _, s, _ in self.deployed.values()]

    async def start(self) -> None:
        if self.lease is not None:  # a standby until the leader is gone
            await self.lease.acquire()
        # heard before any request is taken: a client then knows this one leads by a lease
        self._tasks = [asyncio.create_task(self._heartbeat())]
        if self.static is not None:
            self._lead(self.static)
            await self.static.start()
        self.registry = await self._open_registry()
        self._tasks += [asyncio.create_task(self.registry.follow_pipelines(self._apply_locked)),
                        asyncio.create_task(self._announce())]

    def _lead(self, service: SchedulerService) -> None:
        service.lease = self.lease

    async def _open_registry(self) -> Registry:
        """JetStream may still be electing (a node just back, a bus just resumed): a leader that
        already serves waits for it rather than dying with its requests."""
        while True:
            try:
                return await Registry(self.nc).open()
            except Exception as exc:
                log.warning("registry_unavailable", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(REGISTRY_RETRY_S)

    async def drain(self, grace_s: float) -> None:
        await asyncio.gather(*(s.drain(grace_s) for s in self.services))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for service in self.services:
            await service.stop()
        if self.lease is not None:
            await self.lease.release()  # a standby takes over at once, not after the lease's TTL

    async def _apply_locked(self, name: str, pipeline: Pipeline | None) -> None:
        async with self._lock:
            await self._apply(self.registry, name, pipeline)

    async def _announce(self) -> None:
        """Keep the host's record (budget and refusals) alive in the expiring agents bucket."""
        while True:
            try:
                await self.registry.put_agent(self.budget)
            except Exception:
                log.exception("announce_failed")
            await asyncio.sleep(AGENT_TTL_S / 3)

    async def _heartbeat(self) -> None:
        """Bus clients end the streams of a scheduler they stop hearing from (SCHEDULER_SILENCE_S)."""
        while True:
            beat = SchedulerHeartbeat(scheduler_id=self.scheduler_id, models=[s.model for s in self.services],
                                      lease=self.lease.key if self.lease is not None else "")
            try:
                await self.nc.publish(subjects.SCHEDULERS_HEARTBEAT, encode(beat))
            except Exception as exc:  # the bus is down: the next beat will tell
                log.warning("heartbeat_failed", error=str(exc))
            await asyncio.sleep(SCHEDULER_HEARTBEAT_S)

    async def _apply(self, registry: Registry, name: str, pipeline: Pipeline | None) -> None:
        current = self.deployed.get(name)
        wanted = pipeline is not None and pipeline.serves
        if not wanted and self.budget.refused.pop(name, None) is not None:
            await registry.put_agent(self.budget)
        if current is not None and (not wanted or current[0] != pipeline.generation):
            _, service, _ = self.deployed.pop(name)
            await service.drain(UNDEPLOY_GRACE_S)
            await service.stop()
            log.info("deployment_stopped", model=service.model)
        if not wanted or name in self.deployed:
            return
        try:
            deployed = await load_deployed(registry, pipeline)
            config = deployed.engine_config()
            reserved = [r for _, _, r in self.deployed.values()]
            if (why := fits(free_resources(self.budget, reserved), deployed.engine_resources())) is not None:
                raise ConfigError(f"the scheduler has no room for the engine: it {why}")
        except ConfigError as exc:
            log.error("deployment_refused", pipeline=name, error=str(exc))
            self.budget.refused[name] = str(exc)
            await registry.put_agent(self.budget)
            return
        if self.budget.refused.pop(name, None) is not None:
            await registry.put_agent(self.budget)
        service = SchedulerService(self.nc, config, self.scheduler_id)
        self._lead(service)
        await service.start()
        self.deployed[name] = (pipeline.generation, service, deployed.engine_resources())
        log.info("deployment_started", model=config.model, generation=pipeline.generation)
