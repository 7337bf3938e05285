"""python -m services.agent: the worker agent, one per host: starts, scales and stops the worker
replicas of the pipelines deployed there."""

from __future__ import annotations

import argparse
import asyncio
import socket
import tempfile
import uuid
from pathlib import Path

from services.agent.agent import Agent
from shared import log as sylog
from shared.bus import connect
from shared.bus.lifecycle import serve_until_signalled
from shared.config import add_agent_args, add_nats_arg, add_worker_args
from shared.control.agents import default_labels, host_accels, host_address, qaic_runtime
from shared.control.deploy_config import check_label, parse_memory
from shared.control.registry import AgentRecord


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Switchyard worker host (agent)")
    add_nats_arg(parser)
    add_worker_args(parser)  # --dtype, --nice, --quant-activations, --compile and --deterministic go on to the workers it starts
    add_agent_args(parser)
    args, _ = parser.parse_known_args()
    sylog.configure("agent")
    accels = host_accels(args.accel)
    record = AgentRecord(agent_id=args.agent_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
                         accel=accels[0], offers=accels, device_group=args.device_group, cpus=args.agent_cpus,
                         memory=parse_memory("--agent-memory", args.agent_memory),
                         qaic_socs=args.qaic_socs if "qaic" in accels else 0,
                         qaic_emulated="qaic" in accels and qaic_runtime() is None,
                         labels=default_labels(socket.gethostname()) + [
                             check_label("--label", label) for label in args.labels], ip=host_address())
    log_dir = Path(args.agent_log_dir or tempfile.mkdtemp(prefix="switchyard-agent-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    worker_args = ["--dtype", args.dtype, "--nice", str(args.nice), "--quant-activations", args.quant_activations] + \
        ({True: ["--compile"], False: ["--no-compile"], None: []}[args.compile]) + \
        (["--deterministic"] if args.deterministic else [])

    async def run() -> None:
        nc = await connect(args.nats_url, f"agent-{record.agent_id}")
        agent = Agent(nc, record, log_dir, worker_args, args.nats_url,
                      scaling=(args.scale_up_after_s, args.scale_down_after_s))
        await serve_until_signalled(nc, agent, 30.0)

    asyncio.run(run())


if __name__ == "__main__":
    main()
