"""`from switchyard.engine_config import Acceleration, QaicConfig`: the accelerator a model runs on."""

from switchyard.config import Acceleration, AccelerationWithConfig, QaicConfig

__all__ = ["Acceleration", "AccelerationWithConfig", "QaicConfig"]
