"""The user's script, imported: its InferenceBuilder subclass builds the Inference that predicts."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import sys
from pathlib import Path

import numpy as np
from mac.config.inference import CustomInferenceConfig
from mac.inference import Inference
from mac.inference.creation import InferenceBuilder

from shared.models.custom_artifact import scripts_in


def load_inference(root: Path) -> Inference:
    """Imports every script (their folder on the path, so they import each other) and creates the
    Inference with the one InferenceBuilder subclass they define."""
    builders = []
    for number, script in enumerate(scripts_in(root)):
        sys.path.insert(0, str(script.parent))
        spec = importlib.util.spec_from_file_location(f"custom_model_{number}_{script.stem}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        builders += [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, InferenceBuilder)
                     and c is not InferenceBuilder and c.__module__ == module.__name__]
    if len(builders) != 1:
        raise ValueError(f"the scripts must define one class extending InferenceBuilder, found "
                         f"{[b.__name__ for b in builders] or 'none'}")
    return builders[0]().create(CustomInferenceConfig(model_path=root))


def columns(rows: list[dict]) -> dict[str, np.ndarray]:
    """Records as the product's InferenceData: a numpy array per column."""
    names = list(dict.fromkeys(k for row in rows for k in row))
    return {name: np.array([row.get(name) for row in rows]) for name in names}


def records(output: dict) -> list[dict]:
    """InferenceData back to records (numpy values as plain JSON ones)."""
    if not isinstance(output, dict):
        raise TypeError(f"predict must return a dict of columns (InferenceData), got {type(output).__name__}")
    values = {k: (v.tolist() if isinstance(v, np.ndarray) else list(v)) for k, v in output.items()}
    lengths = {len(v) for v in values.values()}
    if len(lengths) > 1:
        raise ValueError(f"predict returned columns of different lengths: { {k: len(v) for k, v in values.items()} }")
    return [dict(zip(values, row, strict=True)) for row in zip(*values.values(), strict=True)]


async def predict(inference: Inference, rows: list[dict]) -> list[dict]:
    """An AsyncInference's predict is awaited (many at once); a plain Inference's runs in a thread."""
    data = columns(rows)
    if inspect.iscoroutinefunction(inference.predict):
        return records(await inference.predict(data))
    return records(await asyncio.to_thread(inference.predict, data))
