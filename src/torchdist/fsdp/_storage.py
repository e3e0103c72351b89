"""Freeing and re-allocating a gathered parameter's memory while keeping the tensor object.

Autograd saves the unsharded parameter (or flat buffer) in forward; FSDP frees
its storage after forward and refills the same storage before backward, so the
saved tensor sees the refilled values without a new tensor being made.
"""

from __future__ import annotations

import torch

__all__ = ["alloc_storage", "free_storage"]


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give ``tensor`` back storage of its full size (contents undefined until written)."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory; its shape, dtype and the tensor object stay."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)
