"""Placing deployments on worker hosts: which host may run one, and what it has left.

A worker host (an agent, `python -m services.agent`) offers accelerator kinds (cpu, cuda,
qaic), an optional device group, and a budget of CPUs, memory and QAIC SoCs. A deployment reserves its sidekick's
share (sidekick_cpus, sidekick_memory, and for QAIC sidekick_gpus SoCs) per running replica, the way a Kubernetes scheduler places
pods. The engine (the deployment's scheduler queue) reserves its cpus/memory the same way in the
scheduler process, which publishes its budget as a record of kind ENGINE_HOST.
The API refuses a deploy that fits nowhere; the agent uses the same arithmetic before it starts a
replica.
"""

from __future__ import annotations

import glob
import importlib.util
import platform
import socket
from pathlib import Path

from shared.control.deployment import DeployedModel
from shared.control.registry import AgentRecord

ENGINE_HOST = "engine"  # the `accel` of the scheduler process's record
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver sees


def qaic_runtime() -> str | None:
    """Qualcomm's Cloud AI 100 runtime and cards on this host, described; None without them."""
    devices = glob.glob("/dev/qaic_*")
    if importlib.util.find_spec("qaicrt") is None or not devices:
        return None
    return f"qaicrt with {len(devices)} device(s)"


def has_nvidia_gpu() -> bool:
    return NVIDIA_GPUS.is_dir() and any(NVIDIA_GPUS.iterdir())


def host_accels(wanted: str) -> list[str]:
    """The accelerators an agent offers: as asked ("cpu,qaic"), or (auto) the CPU, cuda when an
    NVIDIA GPU is present, and qaic (on the cards, or emulated on a host without them)."""
    if wanted != "auto":
        return wanted.split(",")
    return ["cpu"] + (["cuda"] if has_nvidia_gpu() else []) + ["qaic"]


def offered(agent: AgentRecord) -> list[str]:
    return agent.offers or [agent.accel]


def host_accepts(agent: AgentRecord, deployed: DeployedModel) -> str | None:
    """None if the host can run the deployment's kind of worker; otherwise why not."""
    accel = deployed.version.accel.kind
    if accel not in offered(agent):
        return f"host {agent.agent_id} offers accel {' and '.join(map(repr, offered(agent)))}, the model needs {accel!r}"
    group = deployed.version.framework_config.device_group
    if group is not None and agent.device_group != group:
        return f"host {agent.agent_id} is in device group {agent.device_group!r}, the model needs {group!r}"
    label = deployed.deployment_config.deployment_label
    if label is not None and label not in agent.labels:
        return f"host {agent.agent_id} has no label {label!r} (deployment_config.deployment_label)"
    gpus = deployed.deployment_config.sidekick(deployed.version.name).gpus
    if accel == "cpu" and gpus:
        return f"deployment_config.sidekick_gpus = {gpus} is not allowed for accel 'cpu': allowed 0"
    if accel == "qaic" and gpus and gpus < deployed.version.accel.qaic.num_devices:
        return (f"deployment_config.sidekick_gpus = {gpus} SoCs cannot hold a program compiled for "
                f"accel.qaic.num_devices = {deployed.version.accel.qaic.num_devices}")
    return None


# resources as (cpus, bytes of memory, QAIC SoCs)
Resources = tuple[float, int, int]


def default_labels(hostname: str) -> list[str]:
    """The labels every Kubernetes node carries, so a deployment_label the product's docs use
    ("kubernetes.io/os:linux") matches a host out of the box."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return [f"kubernetes.io/os:{platform.system().lower()}", f"kubernetes.io/arch:{arch}",
            f"kubernetes.io/hostname:{hostname}"]


def free_resources(agent: AgentRecord, reserved: list[Resources]) -> Resources:
    return (agent.cpus - sum(r[0] for r in reserved), agent.memory - sum(r[1] for r in reserved),
            agent.qaic_socs - sum(r[2] for r in reserved))


def needs(deployed: DeployedModel, replicas: int) -> Resources:
    cpus, memory, socs = deployed.resources_per_replica()
    return replicas * cpus, replicas * memory, replicas * socs


def fits(free: Resources, need: Resources) -> str | None:
    if need[0] > free[0] + 1e-9:
        return f"needs {need[0]:g} CPUs, {free[0]:g} free"
    if need[1] > free[1]:
        return f"needs {need[1] / 2**20:.0f} MiB of memory, {free[1] / 2**20:.0f} MiB free"
    if need[2] > free[2]:
        return f"needs {need[2]} QAIC SoCs (sidekick_gpus), {free[2]} free"
    return None


def host_address() -> str:
    """This host's address as others would reach it (127.0.0.1 when it has no other)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
