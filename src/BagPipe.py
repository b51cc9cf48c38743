"""Compatibility with the original system's import: ``from BagPipe import init_cache``."""

from bagpipe.api import TrainerCache, init_cache

__all__ = ["TrainerCache", "init_cache"]
