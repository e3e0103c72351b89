"""``ZeroRedundancyOptimizer``: optimizer state sharded across ranks (ZeRO stage 1).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC 2020), section 5.1 (P_os): with data parallelism every
rank holds the same parameters and the same averaged gradients, so the
optimizer's state (Adam's two moments: twice the model's size) need not be
replicated. The parameters are partitioned across the ranks; each rank keeps
the state of, and steps, only its partition, then every rank broadcasts its
updated partition to the others::

    step():  local optimizer steps this rank's partition
             for r in ranks: broadcast(partition r, src=r)   (coalesced per dtype)

Partition: within each parameter group, parameters are taken largest first and
each goes to the rank with the fewest elements so far (PyTorch's greedy rule),
so the same parameters land on the same ranks as with PyTorch.

``state_dict()`` needs ``consolidate_state_dict(to)`` first, on every rank: it
gathers the shards' states on rank ``to``, which then returns a state dict in
the format of the plain (unsharded) optimizer. ``load_state_dict`` takes that
format on every rank and keeps this rank's share.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from torch.optim import Optimizer

from .._c10d.object_collectives import gather_object
from .._c10d.world import WORLD
from .._ddp.sync import broadcast_coalesced
from .._process_group.process_group import ProcessGroup
from ..algorithms.join import Join, JoinHook, Joinable

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


class _ZeROJoinHook(JoinHook):
    def __init__(self, zero: "ZeroRedundancyOptimizer") -> None:
        self.zero = zero

    def main_hook(self) -> None:
        """Step this rank's shard and take part in the parameter broadcasts, as the others do."""
        self.zero.step()


def _checked_params(params) -> list:
    """``params`` as a list, with PyTorch's errors: a bare tensor or a non-iterable is a
    TypeError; an empty list, sparse parameters or parameters of different dense types
    (a shard's flat buckets need one) a ValueError."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}")
    try:
        params = list(params)
    except TypeError as exc:
        raise TypeError("`params` argument should be an iterable of Tensors or dicts, but got "
                        f"{torch.typename(params)}") from exc
    if not params:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(entry, torch.Tensor) for entry in params):
        tensors = params
    elif all(isinstance(entry, dict) for entry in params):
        if any("params" not in group for group in params):
            raise ValueError("Each parameter group passed-in via `params` must have a 'params' key mapping to the "
                             "parameters in the group")
        # each group's params as a list: a generator read here would be empty for the Optimizer
        params = [{**group, "params": [group["params"]] if isinstance(group["params"], torch.Tensor)
                   else list(group["params"])} for group in params]
        tensors = [t for group in params for t in group["params"]]
    else:
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    if not tensors:
        return params
    first = torch.typename(tensors[0])
    if tensors[0].is_sparse:
        raise ValueError(f"ZeroRedundancyOptimizer only supports using the same dense type for all parameters but "
                         f"got {first}")
    for tensor in tensors[1:]:
        if torch.typename(tensor) != first:
            raise ValueError("ZeroRedundancyOptimizer only supports using the same dense type for all parameters "
                             f"but got both {first} and {torch.typename(tensor)}")
    return params


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wraps ``optimizer_class`` so that each rank holds the state of its share of ``params`` only."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], optimizer_class: type[Optimizer],
                 process_group: ProcessGroup | None = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults: Any) -> None:
        if overlap_with_ddp:
            raise ValueError("ZeroRedundancyOptimizer: overlap_with_ddp=True (stepping inside DDP's comm hook) is "
                             "not supported by torchdist; see docs/design/ddp.md. Pass overlap_with_ddp=False.")
        if not callable(optimizer_class):  # a class, or a factory (functools.partial), as in PyTorch
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass or a callable that makes "
                            f"one, got {optimizer_class!r}")
        self._initialized = False
        self.process_group = process_group if process_group is not None else WORLD.require_default()
        self.world_size = self.process_group.size()
        self.rank = self.process_group.rank()
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._sizes = [0] * self.world_size
        self._rank_of: dict[int, int] = {}  # id(param) -> owning rank
        self._all_state_dicts: list[dict] = []
        params = _checked_params(params)
        Optimizer.__init__(self, params, defaults)  # calls add_param_group for each group
        Joinable.__init__(self)
        self.optim = optimizer_class(self._local_groups(), **defaults)
        self._initialized = True
        self._buckets: list[torch.Tensor] = []
        if parameters_as_bucket_view:
            self._build_param_buckets()
        # the local optimizer's groups hold its defaults too (weight_decay, ...): show them here
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    # -- partitioning -------------------------------------------------------------------------
    def _assign(self, group: dict) -> None:
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = min(range(self.world_size), key=lambda r: self._sizes[r])
            self._sizes[rank] += p.numel()
            self._rank_of[id(p)] = rank

    def _local_group(self, group: dict, rank: int) -> dict:
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in group["params"] if self._rank_of[id(p)] == rank]
        return local

    def _local_groups(self) -> list[dict]:
        return [self._local_group(g, self.rank) for g in self.param_groups]

    def _params_of(self, rank: int) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if self._rank_of[id(p)] == rank]

    def add_param_group(self, param_group: dict) -> None:
        Optimizer.add_param_group(self, param_group)
        self._assign(self.param_groups[-1])
        if self._initialized:
            self.optim.add_param_group(self._local_group(self.param_groups[-1], self.rank))
            if self.parameters_as_bucket_view:
                self._build_param_buckets()

    def _build_param_buckets(self) -> None:
        """``parameters_as_bucket_view``: each rank's parameters become views of one flat tensor per dtype."""
        self._buckets = []
        with torch.no_grad():
            for rank in range(self.world_size):
                by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
                for p in self._params_of(rank):
                    by_dtype.setdefault(p.dtype, []).append(p)
                for dtype, params in by_dtype.items():
                    flat = torch.cat([p.detach().reshape(-1) for p in params])
                    offset = 0
                    for p in params:
                        p.data = flat[offset:offset + p.numel()].view_as(p)
                        offset += p.numel()
                    self._buckets.append(flat)

    # -- stepping -------------------------------------------------------------------------------
    @staticmethod
    def _sync_param_groups(source: list[dict], destination: list[dict]) -> None:
        for src, dst in zip(source, destination):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step this rank's partition, then broadcast every partition from its owner."""
        Join.notify_join_context(self)
        self._sync_param_groups(self.param_groups, self.optim.param_groups)  # e.g. a scheduler changed lr
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        self._sync_params()
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _sync_params(self) -> None:
        for rank in range(self.world_size):
            params = self._params_of(rank)
            if params:
                broadcast_coalesced(params, rank, self.process_group)

    # -- state dicts ----------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state on group rank ``to``; call it on every rank."""
        self._sync_param_groups(self.param_groups, self.optim.param_groups)  # e.g. a scheduler changed lr
        local = self.optim.state_dict()
        gathered: list | None = [None] * self.world_size if self.rank == to else None
        gather_object(local, gathered, group=self.process_group, group_dst=to)
        self._all_state_dicts = gathered if gathered is not None else []

    def state_dict(self) -> dict[str, Any]:
        """The full state in the plain optimizer's format; only on the rank given to consolidate_state_dict."""
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant to save the global "
                "state.")
        global_index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict[int, Any] = {}
        for rank, local in enumerate(self._all_state_dicts):
            local_params = [p for g in self.param_groups for p in g["params"] if self._rank_of[id(p)] == rank]
            # the local optimizer numbers its parameters group by group, in order
            for local_index, p in enumerate(local_params):
                if local_index in local["state"]:
                    state[global_index[id(p)]] = local["state"][local_index]
        param_groups = []
        for group in self.param_groups:  # today's hyperparameters, as the caller sees them
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = [global_index[id(p)] for p in group["params"]]
            param_groups.append(entry)
        return {"state": dict(sorted(state.items())), "param_groups": param_groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (the plain optimizer's format); this rank keeps its partition's state."""
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(state_dict['param_groups'])} parameter groups, the "
                             f"optimizer has {len(self.param_groups)}")
        all_params = [p for g in self.param_groups for p in g["params"]]
        local_state: dict[int, Any] = {}
        local_groups = []
        local_index = 0
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"loaded parameter group has {len(saved['params'])} parameters, the optimizer's "
                                 f"has {len(group['params'])}")
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
            entry = {k: v for k, v in saved.items() if k != "params"}
            entry["params"] = []
            for saved_index, p in zip(saved["params"], group["params"]):
                if self._rank_of[id(p)] != self.rank:
                    continue
                if saved_index in state_dict["state"]:
                    local_state[local_index] = state_dict["state"][saved_index]
                entry["params"].append(local_index)
                local_index += 1
            local_groups.append(entry)
        assert local_index == len([p for p in all_params if self._rank_of[id(p)] == self.rank])
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    # -- Joinable ---------------------------------------------------------------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        return _ZeROJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.param_groups[0]["params"][0].device

    @property
    def join_process_group(self):
        return self.process_group
