"""Inference and AsyncInference: a model plus predict(input_data) -> output data."""

from __future__ import annotations

from typing import Any

from mac.types import InferenceData


class Inference:
    """Subclasses say which model types they take (expected_model_types) and implement _predict."""

    def __init__(self):
        self._model = None

    @property
    def expected_model_types(self) -> set:
        return set()

    @property
    def model(self) -> Any:
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        expected = self.expected_model_types
        if expected and not isinstance(model, tuple(expected)):
            names = ", ".join(sorted(t.__name__ for t in expected))
            raise TypeError(f"{type(self).__name__}.model must be one of {names}, got {type(model).__name__}")
        self._model = model

    def predict(self, input_data: InferenceData) -> InferenceData:
        return self._predict(input_data)

    def _predict(self, input_data: InferenceData) -> InferenceData:
        raise NotImplementedError(f"{type(self).__name__} must implement _predict")


class AsyncInference(Inference):
    """predict is a coroutine: many run at once, each awaiting the engine (continuous batching)."""

    async def predict(self, input_data: InferenceData) -> InferenceData:
        return await self._predict(input_data)

    async def _predict(self, input_data: InferenceData) -> InferenceData:
        raise NotImplementedError(f"{type(self).__name__} must implement async _predict")


__all__ = ["AsyncInference", "Inference", "InferenceData"]
