"""`switchyard serve --from <registry>/<repository>:<tag>`: a published pipeline pulled from an OCI
registry and served by a stack of its own (its own nats-server, store and cache, as `make run`)."""

from __future__ import annotations

import argparse
import sys

import msgspec

from shared.control import pipeline_artifact
from shared.control.oci import Reference, Registry
from shared.models.model_files import cache_root
from switchyard import launcher
from switchyard.client import Client


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="switchyard serve", allow_abbrev=False,
                                     description="Serve a published pipeline; other flags go to `make run`'s launcher")
    parser.add_argument("--from", dest="source", required=True, help="host[:port]/repository:tag (or @sha256:...)")
    parser.add_argument("--plain-http", action="store_true", help="speak plain HTTP to the registry (a local one)")
    args, rest = parser.parse_known_args(argv)
    try:
        ref = Reference.parse(args.source)
        with Registry(ref.host, plain_http=args.plain_http) as oci:
            config, files, digest = pipeline_artifact.pull(oci, ref, cache_root() / "published")
    except Exception as exc:
        sys.exit(f"[serve] cannot pull {args.source}: {type(exc).__name__}: {exc}")
    name = config["pipeline"]["name"]
    print(f"[serve] pulled {ref} ({digest}): pipeline {name!r}, published by {config['engine_version']}", flush=True)
    launcher.main(rest, after_ready=lambda stack, service_args: deploy(stack, service_args, config, files))


def deploy(stack, service_args: list[str], config: dict, files: dict) -> None:
    """The artifact's model versions uploaded and configured as they were, its pipeline built and deployed."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--api-key")
    key = (parser.parse_known_args(service_args)[0].api_key or "").split(",")[0] or None
    wl = Client(stack.base_url, api_key=key)
    versions = {}
    for m in config["models"]:
        accel = {"qaic": m["accel"]["qaic"]} if m["accel"].get("qaic") else m["accel"]["kind"]
        metadata = {"name": m["name"], "visibility": m["visibility"], "workspace_id": m["workspace_id"],
                    "input_schema": m["input_schema"], "output_schema": m["output_schema"],
                    "conversion": {"framework": m["framework"], "accel": accel, "python_version": m["python_version"],
                                   "framework_config": {"framework": m["framework"], "config": m["framework_config"]}}}
        path = files[f"{m['name']}/{m['version']}/{m['file_name']}"]
        with open(path, "rb") as f:
            record = wl._post("/v1/api/models/upload_and_convert", data={"metadata": msgspec.json.encode(metadata).decode()},
                              files={"file": (m["file_name"], f, "application/octet-stream")})["model"]
        wl._post("/v1/api/models/configure", json={
            "name": m["name"], "version": record["version"], "batch_config": m["batch_config"],
            "continuous_batching_config": m["continuous_batching_config"], "openai_config": m["openai_config"]})
        versions[(m["name"], m["version"])] = record["version"]
    pipeline = wl.build_pipeline(config["pipeline"]["name"]).clear()
    for step in config["pipeline"]["steps"]:
        pipeline.record = pipeline._call("add_step", model=step["model"],
                                         version=versions[(step["model"], step["version"])])["pipeline"]
    pipeline.deploy(deployment_config=config["deployment_config"])
    print(f"[serve] serving pipeline {pipeline.name!r} at {pipeline.url()}/openai/v1", flush=True)
