"""``local_map``: run a function written for plain tensors on the local blocks of DTensors.

::

    wrapped(*args, **kwargs)
        flat args ─► DTensor: checked against in_placements (redistributed if asked, else ValueError),
                     then ``to_local(grad_placements=in_grad_placements[i])``; anything else passed as is
        ─► func(*local args, **kwargs)
        ─► flat outputs: tensor ─► ``DTensor.from_local(out, mesh, out_placements[i])``; non-tensor ─► as is
           (only when some argument was a DTensor; otherwise func's result is returned untouched)

Gradients flow through ``to_local``/``from_local``: the local gradient of an input comes back as a DTensor
with ``in_grad_placements`` (default: the input's placements). PyTorch 2.13's semantics and error messages;
``kwargs`` are passed through unconverted, as PyTorch does.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...device_mesh import DeviceMesh
from .._api import DTensor
from .._placements import Placement

__all__ = ["local_map"]

PlacementType = Optional[Sequence[Placement]]
InputPlacements = Optional[tuple[PlacementType, ...]]
OutputPlacements = Union[PlacementType, tuple[PlacementType, ...]]


def local_map(func: Callable | None = None, out_placements: OutputPlacements = None,
              in_placements: InputPlacements = None, in_grad_placements: InputPlacements = None,
              device_mesh: DeviceMesh | None = None, *, redistribute_inputs: bool = False) -> Callable:
    """``func`` made to take DTensors: it sees their local blocks, and its tensor outputs become DTensors.

    ``in_placements``/``in_grad_placements``/``out_placements`` give one entry per flattened argument/output
    (``None`` for non-tensors); without ``func`` this is a decorator. See torch's ``local_map``.
    """
    if func is None:  # decorator form: @local_map(out_placements=..., ...)
        def decorated(fn: Callable) -> Callable:
            return local_map(fn, out_placements, in_placements, in_grad_placements, device_mesh,
                             redistribute_inputs=redistribute_inputs)
        return decorated
    return functools.partial(_local_map_wrapped, func, out_placements, in_placements, in_grad_placements,
                             device_mesh, redistribute_inputs)


def _local_map_wrapped(func: Callable, out_placements: OutputPlacements, in_placements: InputPlacements,
                       in_grad_placements: InputPlacements, device_mesh: DeviceMesh | None,
                       redistribute_inputs: bool, *args: Any, **kwargs: Any) -> Any:
    flat_args, args_spec = tree_flatten(args)
    if in_placements is not None and len(in_placements) != len(flat_args):
        raise AssertionError(f"in_placements length {len(in_placements)} does not match the number of input args "
                             f"{len(flat_args)}!")
    flat_local, seen_dtensor = [], False
    for idx, arg in enumerate(flat_args):
        if isinstance(arg, DTensor):
            if device_mesh is None:  # the first DTensor argument's mesh carries the outputs
                device_mesh = arg.device_mesh
            seen_dtensor = True
            flat_local.append(_to_local_input(arg, idx, in_placements, in_grad_placements, redistribute_inputs))
        else:
            # A plain tensor skips the check (PyTorch's rule); any other value must have no placements.
            if in_placements is not None and not isinstance(arg, torch.Tensor) and in_placements[idx] is not None:
                raise AssertionError(f"Non-Tensor input {arg} expects None placements but received "
                                     f"{in_placements[idx]}!")
            flat_local.append(arg)
    out = func(*tree_unflatten(flat_local, args_spec), **kwargs)
    if not seen_dtensor:  # no DTensor in: run as a plain function, out_placements ignored
        return out
    return _wrap_outputs(out, out_placements, device_mesh)


def _to_local_input(arg: DTensor, idx: int, in_placements: InputPlacements, in_grad_placements: InputPlacements,
                    redistribute_inputs: bool) -> torch.Tensor:
    """The local block of DTensor argument ``idx``, after checking (or redistributing to) its required placements."""
    if in_placements is not None:
        spec = in_placements[idx]
        if spec is None:
            raise AssertionError(f"DTensor input {arg} expects placements but received {spec}!")
        spec = tuple(spec)
        if arg.placements != spec:
            if not redistribute_inputs:
                raise ValueError(f"arg {arg} in local_map has a mismatched placements: arg placements is "
                                 f"{arg.placements} but the input placements is {spec}! If redistribute_inputs is "
                                 "wanted, set redistribute_inputs=True to local_map.")
            arg = arg.redistribute(placements=spec)
    if in_grad_placements is None:
        return arg.to_local()
    grad_spec = in_grad_placements[idx]
    if grad_spec is None:
        raise AssertionError(f"DTensor input {arg} expects in grad placements but received {grad_spec}!")
    return arg.to_local(grad_placements=tuple(grad_spec))


def _wrap_outputs(out: Any, out_placements: OutputPlacements, device_mesh: DeviceMesh) -> Any:
    """Each flattened tensor output as a DTensor with its ``out_placements`` entry; other values unchanged."""
    flat_out, out_spec = tree_flatten(out)
    # A tuple gives one PlacementType per output; anything else (a list of placements, None) is the only output's.
    per_output = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(flat_out) != len(per_output):
        raise AssertionError(f"local_map requires one PlacementType be provided for each output value, received "
                             f"{len(per_output)} out_placements but {len(flat_out)} is expected!")
    wrapped = []
    for value, spec in zip(flat_out, per_output):
        if isinstance(value, torch.Tensor):
            if isinstance(value, DTensor):
                raise AssertionError(f"torch.Tensor output expected but received {type(value)}: {value}")
            wrapped.append(DTensor.from_local(value, device_mesh, spec, run_check=False))
        else:
            if spec is not None:
                raise AssertionError(f"Non-tensor output {value} expects None placements but received {spec}!")
            wrapped.append(value)
    return tree_unflatten(wrapped, out_spec)
