"""``torchdist.utils``: data loading helpers (``torchdist.utils.data``). Re-exports only."""

from . import data

__all__ = ["data"]
