"""Placing deployments on worker hosts: which host may run one, and what it has left.

A worker host (an agent, `python -m services.worker.agent`) offers one accelerator kind, an
optional device group, and a budget of CPUs and memory. A deployment reserves its sidekick's
share (sidekick_cpus, sidekick_memory) per running replica, the way a Kubernetes scheduler places
pods. The engine (the deployment's scheduler queue) reserves its cpus/memory the same way in the
scheduler process, which publishes its budget as a record of kind ENGINE_HOST.
The API refuses a deploy that fits nowhere; the agent uses the same arithmetic before it starts a
replica.
"""

from __future__ import annotations

from pathlib import Path

from shared.deployment import DeployedModel
from shared.registry import AgentRecord

ENGINE_HOST = "engine"  # the `accel` of the scheduler process's record
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver sees


def host_accel(wanted: str) -> str:
    """The accelerator an agent offers: as asked, or (auto) cuda when an NVIDIA GPU is present."""
    if wanted != "auto":
        return wanted
    return "cuda" if NVIDIA_GPUS.is_dir() and any(NVIDIA_GPUS.iterdir()) else "cpu"


def host_accepts(agent: AgentRecord, deployed: DeployedModel) -> str | None:
    """None if the host can run the deployment's kind of worker; otherwise why not."""
    accel = deployed.version.accel.kind
    if agent.accel != accel:
        return f"host {agent.agent_id} offers accel {agent.accel!r}, the model needs {accel!r}"
    group = deployed.version.framework_config.device_group
    if group is not None and agent.device_group != group:
        return f"host {agent.agent_id} is in device group {agent.device_group!r}, the model needs {group!r}"
    gpus = deployed.deployment_config.sidekick(deployed.version.name).gpus
    if accel == "cpu" and gpus:
        return f"deployment_config.sidekick_gpus = {gpus} is not allowed for accel 'cpu': allowed 0"
    return None


def free_resources(agent: AgentRecord, reserved: list[tuple[float, int]]) -> tuple[float, int]:
    return (agent.cpus - sum(c for c, _ in reserved), agent.memory - sum(m for _, m in reserved))


def needs(deployed: DeployedModel, replicas: int) -> tuple[float, int]:
    cpus, memory = deployed.resources_per_replica()
    return replicas * cpus, replicas * memory


def fits(free: tuple[float, int], need: tuple[float, int]) -> str | None:
    if need[0] > free[0] + 1e-9:
        return f"needs {need[0]:g} CPUs, {free[0]:g} free"
    if need[1] > free[1]:
        return f"needs {need[1] / 2**20:.0f} MiB of memory, {free[1] / 2**20:.0f} MiB free"
    return None
