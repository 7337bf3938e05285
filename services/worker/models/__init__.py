"""Model architectures, picked by config.json's `architectures[0]` through a small registry."""

from services.worker.models.registry import model_class_for

__all__ = ["model_class_for"]
