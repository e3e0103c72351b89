"""``context_parallel``: shard the sequence buffers over a 1-D mesh and run SDPA as ring attention inside.

On entry each buffer is rearranged by the load balancer (head-tail, when enabled and the sequence length divides
into ``2 x cp_size`` chunks; see ``_load_balance``), cut into ``cp_size`` shards along its sequence dimension
(torch.chunk's rule, as ``Shard``), and replaced in place (``resize_`` + ``copy_``) by this rank's shard.
Inside, ``torch.nn.functional.scaled_dot_product_attention`` is replaced by :func:`_cp_sdpa`, which takes the
local query/key/value shards (sequence on dim 2) and returns the local shard of the full-sequence attention
(``_ring``). On exit SDPA is put back, and the buffers get their full contents again, except
``no_restore_buffers``. :func:`context_parallel_unshard` gathers shards (an output, a gradient) back into the
original order.

PyTorch 2.13 routes the same call through DTensor dispatch to its flash/efficient kernels, which CPU lacks; here
the ring is plain tensor math over torchdist's collectives and point-to-point ops, so it runs on CPU.
"""

from __future__ import annotations

import contextlib
import math
from typing import Generator, Mapping, Sequence

import torch
import torch.nn.functional as F

from ...._c10d.collectives import all_gather_single
from ...._c10d.init import get_rank
from ..._placements import shard_size_and_offset
from ._load_balance import _create_default_load_balancer, _LoadBalancer
from ._options import _cp_options, _RotateMethod, set_rotate_method
from ._ring import ring_attention

__all__ = [
    "_context_parallel_shard",
    "_cp_options",
    "_RotateMethod",
    "context_parallel",
    "context_parallel_unshard",
    "set_rotate_method",
]


def _check_mesh(mesh, op: str) -> None:
    if mesh.ndim != 1:
        raise ValueError(f"{op}: context parallelism needs a 1-D mesh, got one of shape {tuple(mesh.shape)}; "
                         f"pass its context-parallel dimension, e.g. mesh['cp']")


def _shard_buffers(mesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                   load_balancer: _LoadBalancer | None) -> list[torch.Tensor]:
    """This rank's shard of each buffer: rearranged by ``load_balancer``, then chunk ``rank`` along ``seq_dim``."""
    indices = load_balancer._generate_indices() if load_balancer is not None else None
    if indices is not None and indices.ndim != 2:
        raise ValueError(f"load balance indices must have shape (1, seq_len) or (B, seq_len), got {indices.shape}")
    world, rank = mesh.size(), mesh.get_local_rank()
    shards = []
    for buffer, dim in zip(buffers, seq_dims):
        if not isinstance(buffer, torch.Tensor):
            raise ValueError(f"Unknown buffer type: {type(buffer)}")
        if indices is not None:
            buffer = _rearrange(buffer, dim, indices)
        length, offset = shard_size_and_offset(buffer.size(dim), world, rank)
        shards.append(buffer.narrow(dim, offset, length).clone())
    return shards


def _rearrange(buffer: torch.Tensor, dim: int, indices: torch.Tensor) -> torch.Tensor:
    """``buffer`` with its positions along ``dim`` taken in the order ``indices`` (one row, or one per batch)."""
    indices = indices.to(buffer.device, torch.long)
    if indices.size(0) == 1 or dim == 0:
        return buffer.index_select(dim, indices[0])
    if indices.size(0) != buffer.size(0):
        raise ValueError(f"Cannot rearrange buffer: load_balance_indices has shape {indices.shape}, "
                         f"but buffer has shape {buffer.shape}.")
    shape = [indices.size(0)] + [1] * (buffer.ndim - 1)
    shape[dim] = indices.size(1)
    return torch.gather(buffer, dim, indices.view(shape).expand(*buffer.shape[:dim], indices.size(1),
                                                               *buffer.shape[dim + 1:]))


class _Ring:
    """What the replaced SDPA needs to know about the context it runs in."""

    def __init__(self, mesh, balanced: bool, uneven: str | None) -> None:
        self.group = mesh.get_group()
        self.rank = get_rank(self.group)
        self.world = mesh.size()
        self.balanced = balanced
        self.uneven = uneven

    def sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        """``scaled_dot_product_attention`` of the local shards (sequence on dim 2) over the whole sequence."""
        if attn_mask is not None:
            raise NotImplementedError("attn_bias is not supported yet")  # PyTorch's CP: no mask or bias
        if dropout_p != 0.0:
            raise NotImplementedError(f"context_parallel: dropout_p={dropout_p} is not supported by ring attention "
                                      f"on CPU; use dropout_p=0.0")
        if enable_gqa:
            raise NotImplementedError("context_parallel: enable_gqa=True is not supported; repeat the key/value "
                                      "heads to the query's count")
        if is_causal and query.size(2) != key.size(2):
            raise NotImplementedError("is_causal requires the same query and context sequence lengths")
        if self.uneven is not None:
            raise NotImplementedError(f"context_parallel: {self.uneven}; ring attention needs equal shards")
        if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
            raise ValueError(f"context_parallel: SDPA expects (batch, heads, seq, dim) tensors, got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
        balanced = self.balanced and is_causal
        if balanced and query.size(2) % 2:
            raise ValueError(f"context_parallel: a load-balanced shard holds two equal chunks, but the query shard "
                             f"has {query.size(2)} positions")
        return ring_attention(query, key, value, self.group, rank=self.rank, world=self.world, is_causal=is_causal,
                              scale=1.0 / math.sqrt(query.size(-1)) if scale is None else scale, balanced=balanced,
                              all_gather=_cp_options.rotate_method is _RotateMethod.ALL_GATHER,
                              convert_to_f32=_cp_options.convert_to_f32)


@contextlib.contextmanager
def context_parallel(mesh, *, buffers: list[torch.Tensor] | None = None, buffer_seq_dims: list[int] | None = None,
                     no_restore_buffers: set[torch.Tensor] | None = None) -> Generator[None, None, None]:
    """Shard ``buffers`` along ``buffer_seq_dims`` over ``mesh`` in place and run SDPA as ring attention inside.

    ``no_restore_buffers`` (a subset of ``buffers``) keep their shard on exit; the others get their full contents
    back. ``buffers`` should hold no ``nn.Parameter``.
    """
    buffers = [] if buffers is None else buffers
    buffer_seq_dims = [] if buffer_seq_dims is None else buffer_seq_dims
    no_restore_buffers = set() if no_restore_buffers is None else no_restore_buffers
    if len(buffers) != len(buffer_seq_dims):
        raise ValueError("`seq_dims` must have the same number of elements as `buffers`.")
    for buffer in no_restore_buffers:
        if not any(b is buffer for b in buffers):
            raise ValueError("`no_restore_buffers` must be a subset of `buffers`.")
    _check_mesh(mesh, "context_parallel")
    world = mesh.size()

    old_balance = _cp_options.enable_load_balance
    balancer = None
    if buffers:
        balancer = _create_default_load_balancer(buffers[0].shape[buffer_seq_dims[0]], world, buffers[0].device)
    balanced = balancer is not None if buffers else old_balance
    uneven = next((f"buffer {i} has sequence length {b.size(d)} along dim {d}, not divisible by the "
                   f"context-parallel size {world}" for i, (b, d) in enumerate(zip(buffers, buffer_seq_dims))
                   if b.size(d) % world), None)
    with torch.no_grad():
        originals = [None if any(b is n for n in no_restore_buffers) else b.clone() for b in buffers]
        for buffer, shard in zip(buffers, _shard_buffers(mesh, buffers, buffer_seq_dims, balancer)):
            buffer.resize_(shard.shape)
            buffer.copy_(shard)

    ring = _Ring(mesh, balanced, uneven)
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = ring.sdpa
    _cp_options.enable_load_balance = balanced
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous
        _cp_options.enable_load_balance = old_balance
        with torch.no_grad():
            for buffer, original in zip(buffers, originals):
                if original is not None:
                    buffer.resize_(original.shape)
                    buffer.copy_(original)


def context_parallel_unshard(mesh, buffers: list[torch.Tensor], seq_dims: list[int],
                             load_balancer: _LoadBalancer | None = None) -> list[torch.Tensor]:
    """Gather shards made by context parallelism (an output, a gradient) into full tensors in sequence order.

    Without ``load_balancer``, the head-tail order is undone when load balancing is enabled and the gathered
    length divides into ``2 x cp_size`` chunks (PyTorch's default), else the shards are only concatenated.
    """
    if len(buffers) != len(seq_dims):
        raise ValueError("`seq_dims` must have the same number of elements as `buffers`.")
    _check_mesh(mesh, "context_parallel_unshard")
    if not buffers:
        return []
    world = mesh.size()
    group = mesh.get_group()
    if load_balancer is None:
        load_balancer = _create_default_load_balancer(buffers[0].shape[seq_dims[0]] * world, world, buffers[0].device)
    restore = load_balancer._generate_indices(restore=True) if load_balancer is not None else None
    if restore is not None and restore.ndim != 2:
        raise ValueError(f"load balance restore indices must have shape (1, seq_len) or (B, seq_len), "
                         f"got {restore.shape}")
    out = []
    with torch.no_grad():
        for buffer, dim in zip(buffers, seq_dims):
            moved = buffer.detach().movedim(dim, 0).contiguous()
            full = moved.new_empty((world * moved.size(0), *moved.shape[1:]))
            if world > 1:
                all_gather_single(full, moved, group=group)
            else:
                full.copy_(moved)
            full = full.movedim(0, dim).contiguous()
            out.append(full if restore is None else _rearrange(full, dim, restore))
    return out


def _context_parallel_shard(mesh, buffers: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                            seq_dims: Sequence[int] | Mapping[str, int],
                            load_balancer: _LoadBalancer | None = None):
    """The shards of ``buffers`` (a list or a dict), rearranged by ``load_balancer`` first when given; sets
    ``_cp_options.enable_load_balance`` to whether one was given, as PyTorch does."""
    _cp_options.enable_load_balance = load_balancer is not None
    if len(buffers) != len(seq_dims):
        raise ValueError("`seq_dims` must have the same number of elements as `buffers`.")
    _check_mesh(mesh, "_context_parallel_shard")
    if isinstance(buffers, Mapping):
        if not isinstance(seq_dims, Mapping) or set(buffers) != set(seq_dims):
            raise ValueError("`seq_dims` must have the pytree structure as `buffers`.")
        keys = list(buffers)
        shards = _shard_buffers(mesh, [buffers[k] for k in keys], [seq_dims[k] for k in keys], load_balancer)
        return dict(zip(keys, shards))
    if isinstance(seq_dims, Mapping):
        raise ValueError("`seq_dims` must have the pytree structure as `buffers`.")
    return _shard_buffers(mesh, list(buffers), list(seq_dims), load_balancer)
