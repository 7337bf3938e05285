"""Session fixtures: the real default model (loaded once) and a real nats-server per session."""

from __future__ import annotations

import os

import pytest

from shared.model_files import default_model_path as _default_model_path


@pytest.fixture(scope="session")
def default_model_path() -> str:
    return _default_model_path()


@pytest.fixture(scope="session")
def loaded_model(default_model_path):
    from services.worker.loader import load_model

    return load_model(default_model_path)


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(default_model_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
