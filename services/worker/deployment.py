"""A worker started for a deployed pipeline (by the agent): its records, and its artifact on disk."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from shared.bus import close, connect
from shared.config import ConfigError
from shared.control.deployment import DeployedModel, load_deployed
from shared.control.registry import Registry
from shared.models.custom_environment import python_for
from shared.models.model_files import artifact_root, cache_root


@dataclass
class CustomRuntime:
    python: str  # the model's own environment (services/custom_runtime/environment.py)
    artifact_dir: str  # the unpacked zip: the user's script, requirements.txt, model/


async def _fetch(nats_url: str, pipeline_name: str, generation: int):
    nc = await connect(nats_url, f"worker-fetch-{pipeline_name}")
    try:
        registry = await Registry(nc).open()
        pipeline = await registry.pipeline(pipeline_name)
        if pipeline is None or not pipeline.deployed or pipeline.generation != generation:
            raise ConfigError(f"pipeline {pipeline_name!r} generation {generation} is no longer deployed")
        deployed = await load_deployed(registry, pipeline)
        custom = None
        path = await registry.model_path(deployed.version)
        deployed.lora_paths = {a.name: await registry.model_path(a) for a in deployed.loras}
        if deployed.version.framework == "custom":
            root = artifact_root(await registry.fetch_artifact(deployed.version, cache_root()))
            custom = CustomRuntime(await asyncio.to_thread(python_for, deployed.version.sha256, root), str(root))
    finally:
        await close(nc)
    return deployed, path, custom


def fetch_deployment(nats_url: str, pipeline_name: str, generation: int) -> tuple[DeployedModel, str,
                                                                                  CustomRuntime | None]:
    """(the deployment's records, the local path to load, a custom model's runtime) — before the
    worker's bus thread starts."""
    return asyncio.run(_fetch(nats_url, pipeline_name, generation))


async def drain_when_orphaned(signalled: asyncio.Event, interval_s: float = 1.0) -> None:
    """If the agent that started this worker dies, drain and exit: a new agent starts its own
    replicas, and an orphan would be a replica nobody counts or stops."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(interval_s)
    signalled.set()
