"""`from switchyard.openai_config import OpenaiConfig`: a model's OpenAI defaults."""

from switchyard.config import OpenaiConfig

__all__ = ["OpenaiConfig"]
