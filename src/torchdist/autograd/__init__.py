"""``torchdist.autograd``: distributed autograd (``torch.distributed.autograd``'s API).

Re-exports only; the context lives in :mod:`.context`, the backward pass in
:mod:`.engine`.
"""

from __future__ import annotations

from .api import backward, context, get_gradients

__all__ = ["context", "backward", "get_gradients"]
