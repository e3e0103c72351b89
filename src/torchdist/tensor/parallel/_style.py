"""Parallel styles: how one submodule is laid out over a 1-D mesh and how its inputs and outputs are converted.

Each style is applied by ``_apply(module, mesh)``: it turns the module's
parameters into DTensors (``distribute_module``'s partition function) and
installs forward hooks that turn plain inputs into DTensors with the declared
layout, redistribute them to the layout the computation wants, and convert
the outputs back. The Megatron-LM pairing (Shoeybi et al., 2019) is
``ColwiseParallel`` then ``RowwiseParallel``: the first splits the output
features, the second the input features, so the pair costs one all-reduce
(or a reduce-scatter when the output is sequence-sharded).

===================  =====================  ==============  =====================
style                parameters             input wanted    output (default)
===================  =====================  ==============  =====================
ColwiseParallel      Linear W, b: Shard(0)  Replicate       Shard(-1), local
                     Embedding W: Shard(1)
RowwiseParallel      Linear W: Shard(1),    Shard(-1)       Replicate, local
                     b: Replicate;
                     Embedding W: Shard(0)  Replicate
SequenceParallel     Replicate (from_local) Shard(seq dim)  Shard(seq dim), DTensor
===================  =====================  ==============  =====================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from ...device_mesh import DeviceMesh
from .._api import DTensor
from .._distribute import distribute_module, distribute_tensor
from .._placements import Placement, Replicate, Shard

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "PrepareModuleInputOutput"]


class ParallelStyle(ABC):
    """A recipe that parallelizes one module; ``parallelize_module`` sets ``src_data_rank`` before applying it."""

    src_data_rank: int | None = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...


def _to_dtensor(tensor: Any, mesh: DeviceMesh, layouts: tuple[Placement, ...], style: str) -> DTensor:
    """A module input as a DTensor: a plain tensor is taken as this rank's block with ``layouts`` (no check)."""
    if isinstance(tensor, DTensor):
        return tensor
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{style}: expecting the module input to be a torch.Tensor or DTensor, got "
                         f"{type(tensor).__name__}; give the module a tensor as first argument")
    return DTensor.from_local(tensor, mesh, layouts, run_check=False)


def _prepare_first_input(style: str, input_layouts: tuple[Placement, ...], desired: tuple[Placement, ...],
                         module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> DTensor:
    """The pre-hook of Colwise/Rowwise: the first input, annotated with ``input_layouts``, moved to ``desired``."""
    if not inputs:
        raise ValueError(f"{style}: {type(module).__name__} was called without positional inputs; pass the input "
                         "tensor positionally")
    tensor = _to_dtensor(inputs[0], mesh, input_layouts, style)
    if input_layouts != desired:
        tensor = tensor.redistribute(placements=desired, async_op=True)
    return tensor


def _prepare_output(output_layouts: tuple[Placement, ...], use_local_output: bool, module: nn.Module,
                    outputs: DTensor, mesh: DeviceMesh) -> Any:
    """The post-hook of Colwise/Rowwise: the output moved to ``output_layouts``, as a local tensor if asked."""
    if outputs.placements != output_layouts:
        outputs = outputs.redistribute(placements=output_layouts, async_op=True)
    return outputs.to_local() if use_local_output else outputs


def _shard_params(module: nn.Module, mesh: DeviceMesh, layouts: dict[str, Placement], src_data_rank: int | None,
                  ) -> None:
    """Replace ``module``'s own parameters by DTensor parameters laid out as ``layouts[name]``."""
    for name, param in list(module.named_parameters(recurse=False)):
        dparam = distribute_tensor(param, mesh, [layouts[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dparam, requires_grad=param.requires_grad))


def _unsupported(style: str, module: nn.Module) -> NotImplementedError:
    return NotImplementedError(f"{style} currently only support nn.Linear and nn.Embedding! Got "
                               f"{type(module).__name__}; lay other modules out with distribute_module or "
                               "PrepareModuleInput/PrepareModuleOutput")


class ColwiseParallel(ParallelStyle):
    """Split a Linear's output features (weight and bias ``Shard(0)``) or an Embedding's columns (``Shard(1)``).

    The input is taken as ``input_layouts`` (default Replicate) and replicated; the output is sharded on its last
    dimension and, unless ``use_local_output=False``, handed on as this rank's local block.
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Shard(-1),)
        self.desired_input_layouts: tuple[Placement, ...] = (Replicate(),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            layouts = {"weight": Shard(0), "bias": Shard(0)}
        elif isinstance(module, nn.Embedding):
            layouts = {"weight": Shard(1)}
        else:
            raise _unsupported("ColwiseParallel", module)
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _shard_params(mod, mesh, layouts, self.src_data_rank) if mod is module else None,
            partial(_prepare_first_input, "ColwiseParallel", self.input_layouts, self.desired_input_layouts),
            partial(_prepare_output, self.output_layouts, self.use_local_output))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output})")


class RowwiseParallel(ParallelStyle):
    """Split a Linear's input features (weight ``Shard(1)``, bias Replicate) or an Embedding's rows (``Shard(0)``).

    A Linear wants its input sharded on the last dimension (default ``input_layouts``); its partial sums are
    reduced to ``output_layouts`` (default Replicate: an all-reduce; ``Shard(1)``: a reduce-scatter). An Embedding
    wants replicated indices and produces partial rows, reduced the same way.
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Shard(-1),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            layouts = {"weight": Shard(1), "bias": Replicate()}
            self.desired_input_layouts: tuple[Placement, ...] = (Shard(-1),)
        elif isinstance(module, nn.Embedding):
            layouts = {"weight": Shard(0)}
            self.desired_input_layouts = (Replicate(),)
        else:
            raise _unsupported("RowwiseParallel", module)
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _shard_params(mod, mesh, layouts, self.src_data_rank) if mod is module else None,
            partial(_prepare_first_input, "RowwiseParallel", self.input_layouts, self.desired_input_layouts),
            partial(_prepare_output, self.output_layouts, self.use_local_output))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output})")


class SequenceParallel(ParallelStyle):
    """Run a module (LayerNorm, RMSNorm, Dropout...) on activations sharded on ``sequence_dim``.

    Parameters are replicated without communication (``from_local``: norm weights start equal on every rank);
    a plain input is taken as this rank's sequence shard, a DTensor input is redistributed to it. The output
    stays a DTensor unless ``use_local_output``.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, nn.Parameter(replicated))

    @staticmethod
    def _prepare_input(sequence_sharding: tuple[Placement, ...], module: nn.Module, inputs: tuple,
                       mesh: DeviceMesh) -> DTensor:
        tensor = inputs[0] if inputs else None
        if isinstance(tensor, DTensor):
            if tensor.placements != sequence_sharding:
                tensor = tensor.redistribute(placements=sequence_sharding, async_op=True)
            return tensor
        if isinstance(tensor, torch.Tensor):
            return DTensor.from_local(tensor, mesh, sequence_sharding, run_check=False)
        raise ValueError(f"expecting input of {module} to be a torch.Tensor or DTensor, but got {tensor}")

    @staticmethod
    def _prepare_output(use_local_output: bool, module: nn.Module, outputs: DTensor, mesh: DeviceMesh) -> Any:
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params,
                                 partial(self._prepare_input, self.sequence_sharding),
                                 partial(self._prepare_output, self.use_local_output))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(sequence_dim={self.sequence_sharding[0].dim}, "
                f"use_local_output={self.use_local_output})")


def _as_tuple(layouts: Placement | tuple[Placement | None, ...] | None) -> tuple[Placement | None, ...] | None:
    return (layouts,) if isinstance(layouts, Placement) else layouts


def _convert(value: Any, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None,
             use_local: bool, what: str) -> Any:
    """One input or output: annotated with ``layout`` (None: left alone), moved to ``desired``, maybe unwrapped."""
    if layout is None:
        return value
    if isinstance(value, DTensor):
        dvalue = value
    elif isinstance(value, torch.Tensor):
        dvalue = DTensor.from_local(value, mesh, (layout,), run_check=False)
    else:
        raise AssertionError(f"expecting input to be a torch.Tensor! {what} is a {type(value).__name__}; give None "
                             "as its layout to leave it alone")
    if desired is not None and layout != desired:
        dvalue = dvalue.redistribute(placements=(desired,))
    return dvalue.to_local() if use_local else dvalue


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs to DTensors with ``input_layouts`` and move them to ``desired_input_layouts``.

    ``None`` in a layout tuple leaves that input alone; keyword inputs use ``input_kwarg_layouts``/
    ``desired_input_kwarg_layouts`` by name. ``use_local_output`` hands the module local tensors.
    """

    def __init__(self, *, input_layouts: Placement | tuple[Placement | None, ...] | None = None,
                 desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise AssertionError("desired module inputs should not be None!")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise AssertionError("input_layouts and desired_input_layouts should have same length!")
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = input_kwarg_layouts or {}
        self.desired_input_kwarg_layouts = desired_input_kwarg_layouts or {}
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(self.desired_input_kwarg_layouts):
            raise AssertionError("input_kwarg_layouts and desired_input_kwarg_layouts should have same length!")

    def _prepare_inputs(self, inputs: Any, mesh: DeviceMesh) -> Any:
        if self.input_layouts is None:
            return inputs
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        if len(inputs) != len(self.input_layouts):
            raise ValueError("module inputs and input_layouts should have same length!")
        assert self.desired_input_layouts is not None  # checked in __init__
        return tuple(_convert(value, mesh, layout, desired, self.use_local_output, f"input {i}")
                     for i, (value, layout, desired)
                     in enumerate(zip(inputs, self.input_layouts, self.desired_input_layouts)))

    def _prepare_inputs_and_kwargs(self, inputs: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[Any, dict]:
        prepared = {key: _convert(value, mesh, self.input_kwarg_layouts.get(key),
                                  self.desired_input_kwarg_layouts.get(key), self.use_local_output,
                                  f"keyword input {key!r}")
                    for key, value in kwargs.items()}
        return self._prepare_inputs(inputs, mesh), prepared

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.with_kwargs:
            module.register_forward_pre_hook(
                lambda _, inputs, kwargs: self._prepare_inputs_and_kwargs(inputs, kwargs, device_mesh),
                with_kwargs=True)
        else:
            module.register_forward_pre_hook(lambda _, inputs: self._prepare_inputs(inputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, "
                f"desired_input_layouts={self.desired_input_layouts}, "
                f"input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs to DTensors with ``output_layouts`` and move them to ``desired_output_layouts``.

    ``None`` leaves an output alone; ``use_local_output`` (default True) hands on local tensors. A single output
    comes back as itself, several as a tuple.
    """

    def __init__(self, *, output_layouts: Placement | tuple[Placement | None, ...],
                 desired_output_layouts: Placement | tuple[Placement, ...], use_local_output: bool = True) -> None:
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        self.use_local_output = use_local_output
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise AssertionError("output_layouts and desired_output_layouts should have same length!")

    def _prepare_outputs(self, outputs: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        if len(outputs) != len(self.output_layouts):
            raise ValueError("module outputs and output_layouts should have same length!")
        prepared = []
        for i, (value, layout, desired) in enumerate(zip(outputs, self.output_layouts, self.desired_output_layouts)):
            # PyTorch redistributes here whenever the layouts differ, a None desired layout included.
            if layout is not None and desired is None:
                raise ValueError(f"PrepareModuleOutput: output {i} has layout {layout} but no desired layout; "
                                 "give a desired layout for every output that has a layout")
            prepared.append(_convert(value, mesh, layout, desired, self.use_local_output, f"output {i}"))
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda _, inputs, outputs: self._prepare_outputs(outputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(output_layouts={self.output_layouts}, "
                f"desired_output_layouts={self.desired_output_layouts}, use_local_output={self.use_local_output})")


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module (``use_local_input`` is the
    former's ``use_local_output``)."""

    def __init__(self, *, input_layouts: Placement | tuple[Placement | None, ...] | None = None,
                 desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_input: bool = False,
                 output_layouts: Placement | tuple[Placement | None, ...],
                 desired_output_layouts: Placement | tuple[Placement, ...],
                 use_local_output: bool = True) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        inp, out = self.prepare_module_input, self.prepare_module_output
        return (f"{type(self).__name__}(input_layouts={inp.input_layouts}, "
                f"desired_input_layouts={inp.desired_input_layouts}, input_kwarg_layouts={inp.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={inp.desired_input_kwarg_layouts}, "
                f"use_local_input={inp.use_local_output}, output_layouts={out.output_layouts}, "
                f"desired_output_layouts={out.desired_output_layouts}, use_local_output={out.use_local_output})")
