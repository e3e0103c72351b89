"""``DTensor``: a torch.Tensor that stands for a global tensor laid out over a DeviceMesh.

The object is a wrapper subclass (``torch.Tensor._make_wrapper_subclass``): it
has the global shape, stride and dtype but no storage; it holds this rank's
block (``_local_tensor``) and the layout (``_spec``). Autograd sees the wrapper,
so gradients are DTensors too; every aten op on it lands in
``__torch_dispatch__`` (``_dispatch.py``), which picks placements, moves data
and runs the op on the local blocks.

The conversions (``from_local``, ``to_local``, ``redistribute``,
``full_tensor``) are autograd Functions whose backward gives the gradient the
placements PyTorch gives it: the forward's input placements, with Partial
replaced by Replicate (a gradient is never left pending a reduction).
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch.utils._pytree import tree_flatten

from ..device_mesh import DeviceMesh
from ..device_mesh._mesh import _mesh_resources
from .._c10d.collectives import broadcast
from ._placements import Placement, Replicate
from ._redistribute import redistribute_local_tensor
from ._spec import DTensorSpec, TensorMeta, global_shape_from_local, normalize_placements

__all__ = ["DTensor"]


def _grad_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """PyTorch's default gradient layout for a forward layout: Partial becomes Replicate."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _current_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh:
    return device_mesh if device_mesh is not None else _mesh_resources.get_current_mesh()


class _ToLocal(torch.autograd.Function):
    """DTensor -> its local block; backward wraps the local gradient with ``grad_placements``."""

    @staticmethod
    def forward(ctx, dtensor: DTensor, grad_placements):  # type: ignore[override]
        ctx.spec = dtensor._spec
        ctx.grad_placements = grad_placements
        return dtensor._local_tensor.view_as(dtensor._local_tensor)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        spec: DTensorSpec = ctx.spec
        placements = ctx.grad_placements
        placements = _grad_placements(spec.placements) if placements is None else tuple(placements)
        # The global stride follows the local gradient's layout (a transposed gradient stays transposed), so
        # that later views of the gradient see the strides its storage really has.
        _, stride = global_shape_from_local(grad_output, spec.mesh, placements)
        grad_spec = DTensorSpec(spec.mesh, placements, TensorMeta(spec.shape, stride, grad_output.dtype))
        return DTensor(grad_output, grad_spec, requires_grad=grad_output.requires_grad), None


class _FromLocal(torch.autograd.Function):
    """Local block -> DTensor; backward brings the gradient to the forward layout and returns its local block."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, run_check: bool,  # type: ignore[override]
                grad_placements):
        ctx.spec = spec
        ctx.grad_placements = grad_placements
        if run_check:
            for mesh_dim, placement in enumerate(spec.placements):
                if placement.is_replicate() and spec.mesh.size(mesh_dim) > 1:
                    local = local.contiguous()
                    broadcast(local, group_src=0, group=spec.mesh.get_group(mesh_dim))
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad_output: DTensor):  # type: ignore[override]
        spec: DTensorSpec = ctx.spec
        target = ctx.grad_placements
        target = _grad_placements(spec.placements) if target is None else tuple(target)
        local = grad_output._local_tensor
        if grad_output.placements != target:
            local = redistribute_local_tensor(local, grad_output._spec, target)
        return local, None, None, None


class _Redistribute(torch.autograd.Function):
    """DTensor -> the same tensor with other placements; backward goes back (Partial targets become Replicate)."""

    @staticmethod
    def forward(ctx, dtensor: DTensor, placements: tuple[Placement, ...], forward_dtype,  # type: ignore[override]
                backward_dtype):
        ctx.spec = dtensor._spec
        ctx.backward_dtype = backward_dtype
        local = dtensor._local_tensor
        original_dtype = local.dtype
        if forward_dtype is not None and forward_dtype != local.dtype:
            local = local.to(forward_dtype)
        spec = dtensor._spec
        if spec.tensor_meta.dtype != local.dtype:
            spec = DTensorSpec(spec.mesh, spec.placements, TensorMeta(spec.shape, spec.stride, local.dtype))
        if placements != spec.placements:
            local = redistribute_local_tensor(local, spec, placements)
        elif local is dtensor._local_tensor:
            local = local.view_as(local)
        ctx.original_dtype = original_dtype
        out_spec = DTensorSpec(spec.mesh, placements, spec.tensor_meta)
        return DTensor(local, out_spec, requires_grad=dtensor.requires_grad)

    @staticmethod
    def backward(ctx, grad_output: DTensor):  # type: ignore[override]
        previous: DTensorSpec = ctx.spec
        local = grad_output._local_tensor
        if ctx.backward_dtype is not None and local.dtype != ctx.backward_dtype:
            local = local.to(ctx.backward_dtype)
        current = DTensorSpec(grad_output._spec.mesh, grad_output.placements,
                              TensorMeta(grad_output.shape, grad_output.stride(), local.dtype))
        # A gradient is never turned back into a Partial: Shard/Replicate -> Partial stays Replicate.
        target = tuple(Replicate() if p.is_partial() and not c.is_partial() else p
                       for c, p in zip(current.placements, previous.placements))
        local = redistribute_local_tensor(local, current, target)
        if local.dtype != ctx.original_dtype:
            local = local.to(ctx.original_dtype)
        spec = DTensorSpec(previous.mesh, target, TensorMeta(previous.shape, grad_output.stride(), local.dtype))
        return DTensor(local, spec, requires_grad=grad_output.requires_grad), None, None, None


def _rebuild_dtensor(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool, state: dict) -> DTensor:
    out = DTensor(local, spec, requires_grad=requires_grad)
    out.__dict__.update(state)
    return out


class DTensor(torch.Tensor):
    """A global tensor of ``shape`` laid out over ``device_mesh`` with ``placements``; this rank holds one block.

    Build one with :meth:`from_local`, :func:`distribute_tensor` or the factories; every rank of the mesh
    must take part (SPMD) in any operation that moves data.
    """

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
        if local_tensor.requires_grad and not requires_grad:
            raise RuntimeError("DTensor: the local tensor requires grad but the DTensor would not; "
                               "build it with DTensor.from_local, which keeps the autograd link")
        out = torch.Tensor._make_wrapper_subclass(
            cls, spec.shape, strides=spec.stride, dtype=local_tensor.dtype, device=local_tensor.device,
            layout=local_tensor.layout, requires_grad=requires_grad)
        out._spec = spec
        out._local_tensor = local_tensor
        return out

    # -- what it is ------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    def __repr__(self) -> str:  # type: ignore[override]
        return f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, " \
               f"placements={self._spec.placements})"

    def __reduce_ex__(self, protocol):
        state = {k: v for k, v in self.__dict__.items() if k not in ("_local_tensor", "_spec")}
        return _rebuild_dtensor, (self._local_tensor.detach(), self._spec, self.requires_grad, state)

    def __deepcopy__(self, memo: dict) -> DTensor:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            local = self._local_tensor.clone()
        out = DTensor(local, self._spec, requires_grad=self.requires_grad)
        memo[id(self)] = out
        for key, value in self.__dict__.items():
            if key not in ("_local_tensor", "_spec"):
                setattr(out, key, copy.deepcopy(value, memo))
        return out

    def __tensor_flatten__(self):
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        spec, requires_grad = flatten_spec
        return DTensor(inner_tensors["_local_tensor"], spec, requires_grad=requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        from ._dispatch import dispatch
        from ._strided import dispatch_foreach_by_index, dispatch_strided, has_strided

        kwargs = kwargs or {}
        dtensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, DTensor)]
        if any(has_strided(x._spec) for x in dtensors):
            return dispatch_strided(func, args, kwargs)
        if func._schema.name.startswith("aten::_foreach_") and len({x.device_mesh for x in dtensors}) > 1:
            return dispatch_foreach_by_index(func, args, kwargs)
        return dispatch(func, args, kwargs)

    # -- conversions -----------------------------------------------------------------------------
    @staticmethod
    def from_local(local_tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                   placements: Sequence[Placement] | None = None, *, run_check: bool = False,
                   shape: torch.Size | None = None, stride: tuple[int, ...] | None = None,
                   grad_placements: Sequence[Placement] | None = None) -> DTensor:
        """A DTensor whose block on this rank is ``local_tensor`` (no copy, no communication unless ``run_check``).

        Without ``shape``/``stride`` every shard is assumed to have ``local_tensor``'s shape.
        ``run_check`` broadcasts Replicate blocks from the first rank of each mesh dimension.
        """
        mesh = _current_mesh(device_mesh)
        if isinstance(local_tensor, DTensor):
            raise RuntimeError("DTensor.from_local: the input is already a DTensor; call to_local() first")
        if placements is None:
            placements = [Replicate() for _ in range(mesh.ndim)]
        placements = normalize_placements(placements, mesh, local_tensor.ndim, "DTensor.from_local")
        if (shape is None) != (stride is None):
            raise RuntimeError(f"Found shape:{shape}, stride:{stride}. Please pass both shape and stride at the "
                               "same time.")
        if shape is None:
            shape, stride = global_shape_from_local(local_tensor, mesh, placements)
        spec = DTensorSpec(mesh, placements, TensorMeta(torch.Size(shape), tuple(stride), local_tensor.dtype))
        return _FromLocal.apply(local_tensor, spec, run_check,
                                tuple(grad_placements) if grad_placements is not None else None)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's block; differentiable (the gradient comes back as a DTensor with ``grad_placements``)."""
        if not torch.is_grad_enabled():
            return self._local_tensor
        if grad_placements is not None:
            grad_placements = normalize_placements(grad_placements, self.device_mesh, self.ndim, "to_local")
        return _ToLocal.apply(self, grad_placements)

    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
                     *, async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> DTensor:
        """The same global tensor with ``placements``, moved by collectives on the mesh dimensions that change.

        ``async_op`` is accepted for PyTorch's signature; the collectives complete before it returns.
        """
        mesh = device_mesh if device_mesh is not None else self.device_mesh
        if mesh != self.device_mesh:
            raise NotImplementedError(f"DTensor.redistribute: moving between meshes ({self.device_mesh} -> {mesh}) "
                                      "is not supported; redistribute on the same mesh")
        if placements is None:
            raise RuntimeError("placements is needed for redistribute!")
        placements = normalize_placements(placements, mesh, self.ndim, "DTensor.redistribute")
        for old, new in zip(self.placements, placements):
            if new.is_partial() and old != new:
                raise RuntimeError(f"Can not redistribute from {old} to {new}, redistributing to Partial is for "
                                   "internal use only!")
        return _Redistribute.apply(self, placements, forward_dtype, backward_dtype)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (all-gathers/all-reduces as needed); differentiable."""
        replicated = _Redistribute.apply(self, tuple(Replicate() for _ in self.placements), None, None)
        return replicated.to_local(grad_placements=grad_placements)
