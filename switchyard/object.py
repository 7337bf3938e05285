"""`from switchyard.object import EntityNotFoundError`: what a lookup of a missing model or pipeline raises."""

from switchyard.client import EntityNotFoundError

__all__ = ["EntityNotFoundError"]
