"""``torchdist.tensor.experimental``: PyTorch's experimental DTensor helpers (``implicit_replication`` so far)."""

from ._implicit import implicit_replication

__all__ = ["implicit_replication"]
