"""InferenceBuilder: create(config) returns the Inference with its model set."""

from __future__ import annotations

import inspect

from mac.config.inference import CustomInferenceConfig
from mac.inference import Inference


class InferenceBuilder:
    def __init_subclass__(cls, **kwargs):
        """`inference` is a property; a subclass that wrote it as a plain method (as the product's
        continuous-batching guide does) gets it as one, so `self.inference` is the instance."""
        super().__init_subclass__(**kwargs)
        method = cls.__dict__.get("inference")
        if inspect.isfunction(method):
            cls.inference = property(method)

    @property
    def inference(self) -> Inference:
        raise NotImplementedError(f"{type(self).__name__} must define the `inference` property")

    def create(self, config: CustomInferenceConfig) -> Inference:
        raise NotImplementedError(f"{type(self).__name__} must implement create(config)")
