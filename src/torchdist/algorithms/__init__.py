"""``torchdist.algorithms`` (``torch.distributed.algorithms``): ``Join`` for uneven inputs and DDP comm hooks.

Re-exports only.
"""

from .join import Join, JoinHook, Joinable

__all__ = ["Join", "JoinHook", "Joinable"]
