"""One FSDP1 unit's parameters as a single flat tensor (``FlatParameter``), and the handle that shards, gathers,
frees and reduces it.

Layout (``N`` elements, ``W`` ranks in the shard group, ``c = ceil(N / W)``)::

    flat:    [ p0 | p1 | (pad) p2 | ... | (pad) ]        N elements, in module.named_parameters() order
    padded:  [ rank 0: c | rank 1: c | ... | rank W-1: c ]   c * W elements, zeros past N
    shard:   rank r keeps padded[r*c : (r+1)*c]

With ``use_orig_params=True`` every parameter starts on a 16-byte boundary and
``N`` is padded to a multiple of ``W`` (as in PyTorch), and each original
parameter stays registered as a 1-D view of its part of the local shard
(possibly empty). Otherwise the module holds only the ``FlatParameter``.

The ``FlatParameter`` object is what autograd sees: unsharding points its
``.data`` at the gathered buffer (``_full[:N]``) and the module's parameters at
views of it, so gradients accumulate into one unsharded ``flat.grad``; freeing
resizes the buffer's storage to 0 (views saved for backward survive and are
refilled by the next all-gather).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._c10d.collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor
from .._process_group.process_group import ProcessGroup
from ._storage import alloc_storage, free_storage
from .api import MixedPrecision

__all__ = ["FlatParameter", "FlatParamHandle", "ParamInfo", "predivide_factor"]

FLAT_PARAM = "_flat_param"
FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"  # the attribute that holds a unit's module (PyTorch's name)
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."  # what state dicts and clean names drop
FSDP_FLATTENED = "_fsdp_flattened"  # marks parameters already managed by an FSDP unit (name as in PyTorch)
_ALIGNMENT_BYTES = 16
_PADDING_VALUE = 42


class _FlatParameterMeta(type(nn.Parameter)):
    """``isinstance(p, FlatParameter)`` checks a marker: flat parameters are plain ``nn.Parameter`` objects (their
    type is ``Parameter``, as PyTorch's are)."""

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, torch.Tensor) and getattr(instance, "_is_flat_param", False)


class FlatParameter(nn.Parameter, metaclass=_FlatParameterMeta):
    """The flat parameter of one FSDP unit (an ``nn.Parameter``; its metadata lives on its ``FlatParamHandle``)."""

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> nn.Parameter:
        param = nn.Parameter(data, requires_grad)
        param._is_flat_param = True
        return param


@dataclass
class ParamInfo:
    """Where an original parameter lives: ``module._parameters[name]``, at ``offset`` in the flat tensor."""

    module: nn.Module
    name: str
    fqn: str  # relative to the unit's wrapped module
    param: nn.Parameter
    offset: int = 0
    shared_with: int | None = None  # index of the first occurrence of a shared parameter

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def freeze_shape(self) -> None:
        self._shape = self.param.shape
        self.numel = self.param.numel()


def predivide_factor(world: int) -> int:
    """A power of two near sqrt(world): gradients are divided by it before the sum and by the rest after, so that
    neither overflows nor underflows in low precision (PyTorch's FSDP1 arithmetic)."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return factor


class FlatParamHandle:
    """Shards one unit's parameters into a ``FlatParameter`` and moves it between sharded and unsharded forms."""

    def __init__(self, infos: list[ParamInfo], shard_group: ProcessGroup | None, replicate_group: ProcessGroup | None,
                 sharded: bool, use_orig_params: bool, mixed_precision: MixedPrecision | None,
                 keep_low_precision_grads: bool = False) -> None:
        self.infos = infos
        self.unique = [i for i in infos if i.shared_with is None]
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.sharded = sharded
        self.use_orig_params = use_orig_params
        self.world = shard_group.size() if sharded and shard_group is not None else 1
        self.rank = shard_group.rank() if sharded and shard_group is not None else 0
        dp_world = (shard_group.size() if shard_group is not None else 1) * (
            replicate_group.size() if replicate_group is not None else 1)
        self.predivide = predivide_factor(dp_world)
        self.postdivide = dp_world / self.predivide
        self.dp_world = dp_world
        dtypes = {i.param.dtype for i in self.unique}
        if len(dtypes) != 1:
            raise ValueError(f"FSDP flattens the parameters of a unit into one tensor and needs one dtype, got "
                             f"{sorted(map(str, dtypes))} for {[i.fqn for i in self.unique]}; wrap the parameters of "
                             "other dtypes in their own FSDP unit")
        self.dtype = dtypes.pop()
        requires = {i.param.requires_grad for i in self.unique}
        if len(requires) != 1 and not use_orig_params:
            raise ValueError("Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`; "
                             f"got mixed for {[i.fqn for i in self.unique]}. Pass use_orig_params=True or wrap the "
                             "frozen parameters in their own FSDP unit")
        mp = mixed_precision
        self.param_dtype = mp.param_dtype if mp is not None and mp.param_dtype is not None else self.dtype
        self.reduce_dtype = (mp.reduce_dtype if mp is not None and mp.reduce_dtype is not None else self.param_dtype)
        self.keep_low_precision_grads = keep_low_precision_grads
        for info in infos:
            info.freeze_shape()
        self._layout(shard_group.size() if shard_group is not None else 1)
        self._build(any(requires))
        self.unsharded = not self._needs_swap
        self.saved_grad_shard: torch.Tensor | None = None
        self.grad_unsharded_pending = False  # no_sync: ``flat.grad`` holds an unsharded, unreduced gradient
        self.ran_post_backward = False

    # -- construction --------------------------------------------------------------------------------------

    def _layout(self, group_size: int) -> None:
        # aligned for the dtype forward and backward use (bf16 with mixed precision), as in PyTorch
        align = _ALIGNMENT_BYTES // self.param_dtype.itemsize if self.use_orig_params else 0
        total = 0
        for info in self.unique:
            if align and total % align:
                total += align - total % align
            info.offset = total
            total += info.numel
        if self.use_orig_params and total % group_size:
            total += group_size - total % group_size
        for info in self.infos:
            if info.shared_with is not None:
                info.offset = self.infos[info.shared_with].offset
        self.numel = total  # N, with alignment padding
        self.chunk = math.ceil(total / self.world) if self.world > 1 else total  # c

    def _build(self, requires_grad: bool) -> None:
        with torch.no_grad():
            full = torch.zeros(self.chunk * self.world, dtype=self.dtype)
            if self.use_orig_params:  # the alignment padding holds PyTorch's marker value (seen in local state dicts)
                full[:self.numel].fill_(_PADDING_VALUE)
            for info in self.unique:
                full[info.offset:info.offset + info.numel].copy_(info.param.detach().reshape(-1))
            local = full[self.rank * self.chunk:(self.rank + 1) * self.chunk].clone() if self.world > 1 else full
        self.local_shard = local
        self.flat = FlatParameter(local, requires_grad=requires_grad)
        setattr(self.flat, FSDP_FLATTENED, True)
        self.flat._handle = self
        # the gathered buffer (param_dtype), freed while sharded; NO_SHARD in full precision uses the shard itself
        self._needs_swap = self.world > 1 or self.param_dtype != self.dtype
        self.full = torch.empty(self.chunk * self.world, dtype=self.param_dtype) if self._needs_swap else local
        if self._needs_swap:
            free_storage(self.full)
        self._gathered: torch.Tensor | None = None  # the buffer the flat parameter points at while unsharded
        for info in self.infos:
            setattr(info.param, FSDP_FLATTENED, True)

    # -- sharded / unsharded -------------------------------------------------------------------------------

    def unshard(self, full_precision: bool = False) -> None:
        """All-gather (or cast) the shard into the full buffer and point the flat parameter at it; with
        ``full_precision`` gather in the parameters' own dtype (``summon_full_params``, state dicts)."""
        if self.unsharded:
            return
        kept = self._gathered
        if kept is not None and kept.dtype == (self.dtype if full_precision else self.param_dtype):
            self.flat.data = kept[:self.numel]  # kept since the last reshard: still current, no gather
            self.unsharded = True
            return
        self.reshard()  # frees a kept buffer of the other precision
        buffer = self.full
        if full_precision and self.param_dtype != self.dtype:
            buffer = torch.empty(self.chunk * self.world, dtype=self.dtype)
        elif not self._needs_swap:
            self.unsharded = True
            return
        else:
            alloc_storage(buffer)
        with torch.no_grad():
            source = self.local_shard.to(buffer.dtype)
            if self.world > 1:
                all_gather_into_tensor(buffer, source, group=self.shard_group)
            else:
                buffer.copy_(source)
        self._gathered = buffer
        self.flat.data = buffer[:self.numel]
        self.unsharded = True

    def reshard(self, free: bool = True) -> None:
        """Point the flat parameter back at its shard and free the gathered buffer; with ``free=False`` keep the
        buffer for the next ``unshard`` (PyTorch's root and SHARD_GRAD_OP after forward, which show the sharded
        flat parameter while keeping the gathered one)."""
        if self.unsharded and (self._needs_swap or self._gathered is not None):
            self.flat.data = self.local_shard
            self.unsharded = False
        if free and self._gathered is not None:
            if self._gathered is self.full:
                free_storage(self.full)
            self._gathered = None

    def writeback(self) -> None:
        """Copy this rank's part of the gathered flat tensor (changed in place by the user) into the shard."""
        if self._gathered is None:
            return
        with torch.no_grad():
            self.local_shard.copy_(self._gathered[self.rank * self.chunk:(self.rank + 1) * self.chunk])

    def unsharded_views(self, source: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``source`` (the unsharded flat, ``N`` elements) in each parameter's shape, shared ones shared."""
        views: list[torch.Tensor] = []
        for info in self.infos:
            if info.shared_with is not None:
                views.append(views[info.shared_with])
            else:
                views.append(source[info.offset:info.offset + info.numel].view(info.shape))
        return views

    def local_range(self, info: ParamInfo) -> tuple[int, int]:
        """The part ``[lo, hi)`` of ``info``'s flat elements that this rank's shard holds, in shard coordinates."""
        start = self.rank * self.chunk
        lo = min(max(info.offset - start, 0), self.chunk)
        hi = min(max(info.offset + info.numel - start, 0), self.chunk)
        return lo, max(lo, hi)

    def sharded_view(self, info: ParamInfo, source: torch.Tensor) -> torch.Tensor:
        """``info``'s part of a shard-sized tensor: 1-D when sharded, the parameter's shape when not."""
        if self.world == 1:
            return source[info.offset:info.offset + info.numel].view(info.shape)
        lo, hi = self.local_range(info)
        return source[lo:hi]

    def use_unsharded_views(self, as_params: bool) -> None:
        """Point the modules at views of the unsharded flat parameter: autograd-tracked tensors for forward
        (``as_params=False``), or ``nn.Parameter`` aliases (``summon_full_params``, state dicts)."""
        source = self.flat.detach() if as_params else self.flat
        for info, view in zip(self.infos, self.unsharded_views(source)):
            params = info.module._parameters
            if self.use_orig_params:
                if as_params:
                    info.param.data = view
                    params[info.name] = info.param
                else:  # a plain tensor in ``_parameters`` during forward, as PyTorch does
                    params[info.name] = view
            elif as_params:
                info.module.__dict__.pop(info.name, None)
                params[info.name] = nn.Parameter(view, requires_grad=self.flat.requires_grad)
            else:
                params.pop(info.name, None)
                info.module.__dict__[info.name] = view

    def use_sharded_views(self) -> None:
        """After resharding: the original parameters (``use_orig_params``) become views of the local shard again;
        otherwise the modules keep plain tensor attributes and only the ``FlatParameter`` is registered."""
        for info in self.infos:
            params = info.module._parameters
            if self.use_orig_params:
                if info.shared_with is None:
                    info.param.data = self.sharded_view(info, self.local_shard)
                params[info.name] = info.param
            elif info.name in params:
                info.module.__dict__[info.name] = params.pop(info.name).detach()

    # -- gradients -----------------------------------------------------------------------------------------

    def prepare_gradient(self) -> None:
        """Before backward: move an existing sharded gradient aside (``saved_grad_shard``) so that autograd
        accumulates only this backward's unsharded gradient into ``flat.grad``. An unsharded gradient (after
        ``no_sync``, or NO_SHARD in full precision) stays in ``flat.grad`` and accumulates, as in PyTorch."""
        if self.grad_unsharded_pending or (self.world == 1 and self.param_dtype == self.dtype):
            if self.use_orig_params:
                self._flat_grad_from_params()
            if self.flat.grad is not None or not self.grad_unsharded_pending:
                return
            self.grad_unsharded_pending = False
        if self.use_orig_params:
            grads = [(info, info.param.grad) for info in self.unique if info.param.grad is not None]
            grad = None
            if grads:
                grad = torch.zeros(self.local_shard.shape, dtype=grads[0][1].dtype)
                for info, g in grads:
                    self.sharded_view(info, grad).copy_(g)
        else:
            grad = self.flat.grad
        if grad is not None:
            self.saved_grad_shard = grad if self.saved_grad_shard is None else self.saved_grad_shard + grad
        self.flat.grad = None
        if self.use_orig_params:
            for info in self.unique:
                info.param.grad = None

    def _flat_grad_from_params(self) -> None:
        """``use_orig_params`` with an unsharded gradient: the original parameters' ``.grad`` are what the user
        sees and changes (``zero_grad``), so ``flat.grad`` is rebuilt from them (None when all are None)."""
        grads = [info.param.grad for info in self.unique]
        if all(g is None for g in grads):
            self.flat.grad = None
            return
        flat_grad = self.flat.grad
        if flat_grad is None or flat_grad.numel() != self.numel:
            flat_grad = torch.zeros(self.numel, dtype=next(g for g in grads if g is not None).dtype)
        with torch.no_grad():
            views = [v for info, v in zip(self.infos, self.unsharded_views(flat_grad)) if info.shared_with is None]
            for grad, view in zip(grads, views):
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
                    view.copy_(grad.reshape(view.shape))
        _set_grad(self.flat, flat_grad)

    def reduce_gradient(self, sync: bool, comm_hook=None, comm_state=None) -> None:
        """After this unit's backward: reduce-scatter (sharded) or all-reduce (NO_SHARD) the averaged gradient
        and add it to the saved shard; without ``sync`` keep it unsharded in ``flat.grad``."""
        grad = self.flat.grad
        if grad is None:
            return
        if not sync:
            self.grad_unsharded_pending = True
            return
        self.grad_unsharded_pending = False
        self.flat.grad = None
        with torch.no_grad():
            grad = grad.to(self.reduce_dtype)
            if self.world > 1:
                padded = F.pad(grad, [0, self.chunk * self.world - grad.numel()])
                out = torch.empty(self.chunk, dtype=grad.dtype)
                if comm_hook is not None:
                    comm_hook(comm_state, padded, out)
                else:
                    _divide(padded, self.predivide)
                    reduce_scatter_tensor(out, padded, group=self.shard_group)
                    if self.replicate_group is not None and self.replicate_group.size() > 1:
                        all_reduce(out, group=self.replicate_group)
                    _divide(out, self.postdivide)
            else:
                out = grad
                if comm_hook is not None:
                    comm_hook(comm_state, out)
                elif self.dp_world > 1:
                    _divide(out, self.predivide)
                    group = self.shard_group if self.shard_group is not None else self.replicate_group
                    all_reduce(out, group=group)
                    _divide(out, self.postdivide)
            if not self.keep_low_precision_grads:
                out = out.to(self.dtype)
            self.saved_grad_shard = out if self.saved_grad_shard is None else self.saved_grad_shard + out

    def finalize_gradient(self) -> None:
        """End of backward: hand the reduced shard to ``flat.grad`` (or the original parameters' ``.grad``)."""
        if self.grad_unsharded_pending:
            if self.use_orig_params:  # expose the unsharded gradient on the original parameters
                grad = self.flat.grad
                for info, view in zip(self.infos, self.unsharded_views(grad)):
                    if info.shared_with is None and info.param.requires_grad:
                        _set_grad(info.param, view)
            return
        grad, self.saved_grad_shard = self.saved_grad_shard, None
        if grad is None:
            return
        if not self.use_orig_params:
            _set_grad(self.flat, grad)
            return
        for info in self.unique:
            view = self.sharded_view(info, grad)
            info.param.grad = view if info.param.requires_grad and view.numel() > 0 else None


def _set_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad = grad`` even when their shapes differ (an unsharded gradient on a sharded parameter, as
    PyTorch's FSDP shows under ``no_sync``)."""
    if grad.shape == param.shape and grad.dtype == param.dtype:
        param.grad = grad
        return
    data = param.data
    param.data = torch.empty(grad.shape, dtype=grad.dtype)
    param.grad = grad
    param.data = data


def _divide(tensor: torch.Tensor, factor: float) -> None:
    if factor > 1:
        tensor.div_(factor)
