"""A worker host (`python -m services.agent`) that runs the worker processes deployments ask for.

It watches the registry's pipelines (the desired state), and every second brings what runs on
this host in line: a deployed pipeline gets its replicas (each `python -m services.worker
--pipeline P --generation G`, which fetches the artifact, loads it and says hello), scaled within
replicas_min..replicas_max; an undeployed or redeployed one has its old replicas drained and
stopped, which frees their memory. It offers accelerator kinds (cpu, cuda, qaic), an optional
device group and a budget of CPUs, memory and QAIC SoCs, reserves what each replica takes, and
says what it runs in the `sy-agents`
bucket (pipelines/status reads it).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from nats.aio.client import Client

from services.agent.replicas import Replicas
from shared import log as sylog
from shared.config import ConfigError
from shared.control.agents import (
    fits,
    free_resources,
    host_accepts,
    needs,
)
from shared.control.deployment import load_deployed
from shared.control.registry import AgentRecord, Pipeline, Registry
from shared.wire import subjects
from shared.wire.messages import WORKER_ANNOUNCE_DECODER, encode
from shared.wire.stats import SCHEDULER_STATS_DECODER, SchedulerStatsRequest

log = sylog.get_logger("agent")
TICK_S = 1.0


class Agent:
    def __init__(self, nc: Client, record: AgentRecord, log_dir: Path, worker_args: list[str], nats_url: str,
                 scaling: tuple[float, float] = (5.0, 30.0)):
        self.nc = nc
        self.scaling = scaling  # (scale up after s, scale down after s)
        self.record = record
        self.log_dir = log_dir
        self.worker_args = worker_args
        self.nats_url = nats_url
        self.registry: Registry | None = None
        self.desired: dict[str, Pipeline] = {}  # pipeline name -> its record, as last seen
        self.running: dict[str, Replicas] = {}  # pipeline name -> what runs here for it
        self.refused: dict[str, str] = {}  # pipeline name -> why this host does not run it now
        self._tasks: list[asyncio.Task] = []
        self._sub = None

    async def start(self) -> None:
        self.registry = await Registry(self.nc).open()
        self._sub = await self.nc.subscribe(subjects.WORKERS_HELLO, cb=self._on_hello)
        self._tasks = [asyncio.create_task(self.registry.follow_pipelines(self._desire)),
                       asyncio.create_task(self._loop())]
        log.info("agent_ready", agent_id=self.record.agent_id, accels=self.record.offers, cpus=self.record.cpus,
                 memory=self.record.memory, qaic_socs=self.record.qaic_socs,
                 qaic="emulated on cpu" if self.record.qaic_emulated else "cards")

    async def drain(self, grace_s: float) -> None:
        for task in self._tasks:
            task.cancel()
        for replicas in self.running.values():
            replicas.stop_all()
        deadline = time.monotonic() + grace_s
        while any(r.proc.poll() is None for rs in self.running.values() for r in rs.replicas):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        for replicas in self.running.values():
            for replica in replicas.replicas:
                if replica.proc.poll() is None:
                    replica.proc.kill()

    async def _on_hello(self, msg) -> None:
        hello = WORKER_ANNOUNCE_DECODER.decode(msg.data)
        for replicas in self.running.values():
            for replica in replicas.replicas:
                if replica.worker_id == hello.worker_id and replica.state == "starting":
                    replica.state = "running"
                    log.info("replica_running", worker_id=hello.worker_id)
                    await self.publish()

    async def _desire(self, name: str, pipeline: Pipeline | None) -> None:
        """The registry's record is the desired state; the loop below converges on it."""
        if pipeline is None:
            self.desired.pop(name, None)
        else:
            self.desired[name] = pipeline

    async def _loop(self) -> None:
        while True:
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile_failed")
            await asyncio.sleep(TICK_S)

    async def reconcile(self) -> None:
        for name, replicas in list(self.running.items()):
            pipeline = self.desired.get(name)
            replicas.reap()
            if pipeline is None or not pipeline.serves or pipeline.generation != replicas.generation:
                replicas.stop_all()
                if not replicas.replicas:
                    del self.running[name]
                    log.info("deployment_released", pipeline=name)
        for name, pipeline in list(self.desired.items()):  # the watch may add one while we adopt
            if pipeline.serves and name not in self.running:
                await self._adopt(pipeline)
            elif not pipeline.serves:
                self.refused.pop(name, None)
        for name, replicas in self.running.items():
            pipeline = self.desired.get(name)
            if pipeline is not None and pipeline.serves and pipeline.generation == replicas.generation:
                await self._scale(replicas)
        await self.publish()

    async def publish(self) -> None:
        """What runs here, for pipelines/status (and the API's placement check)."""
        self.record.workers = [w for rs in self.running.values() for w in rs.states()]
        self.record.refused = dict(self.refused)
        await self.registry.put_agent(self.record)

    async def _adopt(self, pipeline: Pipeline) -> None:
        try:
            deployed = await load_deployed(self.registry, pipeline)
        except ConfigError as exc:
            self.refused[pipeline.name] = str(exc)
            return
        if (why := host_accepts(self.record, deployed)) is not None:
            self.refused[pipeline.name] = why
            return
        if (why := fits(self._free(), needs(deployed, 0))) is not None:
            self.refused[pipeline.name] = why
            return
        self.refused.pop(pipeline.name, None)
        self.running[pipeline.name] = Replicas(deployed, self.nats_url, self.log_dir, self.worker_args,
                                               *self.scaling)
        log.info("deployment_adopted", pipeline=pipeline.name, generation=pipeline.generation)

    def _free(self) -> tuple[float, int]:
        return free_resources(self.record, [needs(rs.deployed, len(rs.live)) for rs in self.running.values()])

    async def _scale(self, replicas: Replicas) -> None:
        stats = None
        try:
            msg = await self.nc.request(subjects.scheduler_stats(replicas.deployed.name),
                                        encode(SchedulerStatsRequest()), timeout=0.5)
            stats = SCHEDULER_STATS_DECODER.decode(msg.data)
        except Exception:
            pass  # the scheduler has not picked the deployment up yet
        wanted = replicas.wanted(stats)
        while len(replicas.occupied) < wanted and fits(self._free(), replicas.deployed.resources_per_replica()) is None:
            replica = replicas.start_one()
            log.info("replica_started", worker_id=replica.worker_id, pid=replica.proc.pid)
        if len(replicas.live) > wanted:
            replicas.stop_one()
