"""`from switchyard.continuous_batching_config import ContinuousBatchingConfig`."""

from switchyard.config import ContinuousBatchingConfig

__all__ = ["ContinuousBatchingConfig"]
