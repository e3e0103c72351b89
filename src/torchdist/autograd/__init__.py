"""``torchdist.autograd``: distributed autograd (``torch.distributed.autograd``'s API).

Re-exports only; the context lives in :mod:`.context`, the backward pass in
:mod:`.engine`.
"""

from __future__ import annotations

from .api import backward, context, get_gradients
from .context import DistAutogradContext

__all__ = ["context", "backward", "get_gradients", "is_available", "DistAutogradContext"]


def is_available() -> bool:
    """Distributed autograd is always built in (PyTorch's answer depends on its build)."""
    return True
