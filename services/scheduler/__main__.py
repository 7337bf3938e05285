"""python -m services.scheduler: admission, per-worker continuous-batching loops, KV allocation,
for the model its flags name and for every deployed pipeline."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket

from services.scheduler.host import SchedulerHost
from services.scheduler.lease import Lease
from shared import log as sylog
from shared.bus import connect
from shared.bus.lifecycle import serve_until_signalled
from shared.config import add_engine_args, add_nats_arg, add_scheduler_args, engine_config_from_args
from shared.control.agents import ENGINE_HOST, host_address
from shared.control.deploy_config import parse_memory
from shared.control.registry import AgentRecord


async def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Switchyard scheduler")
    add_engine_args(parser)
    add_scheduler_args(parser)
    add_nats_arg(parser)
    args, _ = parser.parse_known_args()  # the launcher passes every service the same flags
    config = engine_config_from_args(args)
    sylog.configure("scheduler")
    nc = await connect(args.nats_url, f"scheduler-{config.model}")
    budget = AgentRecord(agent_id=f"scheduler-{socket.gethostname()}-{os.getpid()}", accel=ENGINE_HOST,
                         device_group=None, cpus=args.engine_cpus, ip=host_address(),
                         memory=parse_memory("--engine-memory", args.engine_memory))
    lease = Lease(nc, args.leader_lease) if args.leader_lease else None
    await serve_until_signalled(nc, SchedulerHost(nc, config, budget, lease), config.drain_grace_s)


if __name__ == "__main__":
    asyncio.run(main())
