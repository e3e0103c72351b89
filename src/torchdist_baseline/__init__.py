"""The baseline ``torchdist-bench --compare`` measures against: PyTorch's own c10d.

This adapter lives outside the ``torchdist`` package on purpose: torchdist itself
never imports ``torch.distributed`` (shared/API.md), while a benchmark may, to
compare. ``torchdist.bench`` loads this module only when a comparison is asked for.
"""

from __future__ import annotations

from types import ModuleType

import torch.distributed as reference

__all__ = ["join_reference_group"]


def join_reference_group(backend: str, port: int, rank: int, world_size: int) -> ModuleType:
    """Join a torch.distributed group of ``backend`` (e.g. "gloo") and return the module."""
    reference.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                 world_size=world_size)
    return reference
