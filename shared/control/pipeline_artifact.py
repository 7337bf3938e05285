"""A published pipeline as one OCI artifact: a config (the pipeline, its model versions' records,
the deployment config, the engine's version) and each model version's file as a layer."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

from shared.control.oci import MANIFEST_TYPE, Reference, Registry, descriptor

ARTIFACT_TYPE = "application/vnd.switchyard.pipeline.v1"
CONFIG_TYPE = "application/vnd.switchyard.pipeline.config.v1+json"
MODEL_FILE_TYPE = "application/vnd.switchyard.model.file.v1"


def engine_version() -> str:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    return "switchyard " + tomllib.loads(pyproject.read_text())["project"]["version"]


def push(registry: Registry, ref: Reference, config: dict, files: list[tuple[Path, str, str, int]]) -> str:
    """files: (path, title, sha256 digest, size) per model version file; returns the manifest's digest."""
    config_data = json.dumps(config, sort_keys=True).encode()
    config_desc = descriptor(CONFIG_TYPE, _digest(config_data), len(config_data))
    registry.push_blob(ref.repository, config_desc["digest"], config_desc["size"], config_data)
    layers = []
    for path, title, digest, size in files:
        with open(path, "rb") as f:
            registry.push_blob(ref.repository, digest, size, f)
        layers.append(descriptor(MODEL_FILE_TYPE, digest, size, title))
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": ARTIFACT_TYPE,
                "config": config_desc, "layers": layers,
                "annotations": {"org.opencontainers.image.title": config["pipeline"]["name"],
                                "org.opencontainers.image.version": config["engine_version"]}}
    return registry.push_manifest(ref, manifest)


def pull(registry: Registry, ref: Reference, into: Path) -> tuple[dict, dict[str, Path], str]:
    """(config, {title: local file}, manifest digest); files land in `into`, named by digest."""
    manifest, digest = registry.manifest(ref)
    if manifest.get("artifactType") != ARTIFACT_TYPE or manifest.get("config", {}).get("mediaType") != CONFIG_TYPE:
        raise ValueError(f"{ref} is not a published Switchyard pipeline (artifactType "
                         f"{manifest.get('artifactType')!r})")
    config_path = registry.blob(ref.repository, manifest["config"], _place(into, manifest["config"], "config.json"))
    config = json.loads(config_path.read_text())
    files = {}
    for layer in manifest["layers"]:
        title = layer.get("annotations", {}).get("org.opencontainers.image.title")
        if layer["mediaType"] != MODEL_FILE_TYPE or not title:
            raise ValueError(f"{ref}: layer {layer['digest']} is not a model file")
        files[title] = registry.blob(ref.repository, layer, _place(into, layer, Path(title).name))
    return config, files, digest


def _place(into: Path, desc: dict, name: str) -> Path:
    """A blob's file: a folder per digest, the file under its own name (an upload keeps it)."""
    folder = into / desc["digest"].removeprefix("sha256:")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def _digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"
