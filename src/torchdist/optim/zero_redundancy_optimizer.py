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

``overlap_with_ddp=True`` (PyTorch's): the step runs inside DDP's communication
hook instead (``algorithms/ddp_comm_hooks/ddp_zero_hook.py``), bucket by bucket,
once the bucket's all-reduce is done, so ``step()`` is a no-op. The parameters
are then partitioned by DDP bucket, which is only known once DDP has rebuilt its
buckets: the hook records them in the iteration after the rebuild and
initializes this optimizer (``_init_zero_for_overlap``) at the first bucket of
the next one; until then, nothing is updated (two iterations, three with
``static_graph``, as in PyTorch). Bucket ``i`` goes to rank ``i % world_size``,
or, with ``shard_buckets``, the buckets are cut into pieces of about
``total / world_size`` elements that go to the least loaded ranks (PyTorch's
rule). Each rank's pieces become views of one flat tensor per piece, which its
owner broadcasts after stepping it.

The module is over 400 lines because the overlap mode is the same optimizer in
another schedule: its partition, local step and state dicts share this class's state.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Iterable

import torch
from torch.optim import Optimizer

from .._c10d.groups import get_global_rank
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

# The optimizers PyTorch has a functional twin of (``functional_optim_map``), the only ones it
# overlaps with DDP. Here the class itself steps a bucket's parameters: it skips those
# whose ``.grad`` is None, which is how a bucket's step leaves the others alone.
_OVERLAP_OPTIMIZERS = (torch.optim.Adagrad, torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD,
                       torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.Adamax)

_NOT_INITIALIZED = ("This method should not be called until this ZeroRedundancyOptimizer instance has been fully "
                    "initialized")


class _OverlapStatus(enum.IntEnum):
    """Where an ``overlap_with_ddp`` optimizer is::

        UNINITIALIZED ──DDP rebuilt──▶ DDP_HAS_REBUILT_BUCKETS ──bucket 0 again──▶ INITIALIZED
        (hook only all-reduces)       (hook records each bucket's parameters)      (hook steps)
    """

    UNINITIALIZED = 0
    DDP_HAS_REBUILT_BUCKETS = 1
    INITIALIZED = 2


class _DDPBucketAssignment:
    """The parameters ``parameters`` of DDP bucket ``bucket_index`` (from position ``offset`` in
    the bucket) that one rank steps; ``tensor`` is the flat tensor they are views of, broadcast
    by that rank after its step."""

    def __init__(self, bucket_index: int, parameters: list[torch.Tensor], offset: int) -> None:
        if not parameters:
            raise ValueError("Empty bucket assignment")
        self.bucket_index = bucket_index
        self.parameters = parameters
        self.offset = offset
        self.device = parameters[0].device
        self.tensor: torch.Tensor | None = None


class _OverlapInfo:
    """What the DDP hook and the optimizer share when they overlap (PyTorch's ``_OverlapInfo``).

    Set once: ``params_per_bucket`` (recorded by the hook), ``shard_buckets`` and
    ``total_size`` (by the hook's constructor), then at initialization the
    partition: ``params_per_rank`` (each rank's parameters, in its local optimizer's
    order), ``offsets`` (bucket index -> position of its first parameter in this
    rank's list), ``assigned_ranks_per_bucket``, ``num_bucket_assignments``.
    Per iteration: the broadcast handles, the buckets seen and their futures.
    """

    def __init__(self, world_size: int) -> None:
        self.status = _OverlapStatus.UNINITIALIZED
        self.shard_buckets = False
        self.params_per_bucket: list[list[torch.Tensor]] = []
        self.params_per_rank: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        self.offsets: dict[int, int] = {}
        self.assigned_ranks_per_bucket: list[set[int]] = []
        self.num_bucket_assignments = 0
        self.total_size: int | None = None
        self.broadcast_handles: list = []
        self.bucket_indices_seen: list[int] = []
        self.bucket_index_to_future: dict[int, torch.futures.Future] = {}
        self.bucket_index_to_bucket: dict[int, Any] = {}

    def wait_for_broadcasts(self) -> None:
        """Wait for this iteration's parameter broadcasts (one per bucket assignment)."""
        if len(self.broadcast_handles) != self.num_bucket_assignments:
            raise AssertionError(f"Missing at least one broadcast handle: {len(self.broadcast_handles)} of "
                                 f"{self.num_bucket_assignments}")
        for handle in self.broadcast_handles:
            handle.wait()
        self.broadcast_handles.clear()

    def clear_per_iter_info(self) -> None:
        self.bucket_indices_seen.clear()
        self.bucket_index_to_future.clear()
        self.bucket_index_to_bucket.clear()


def _min_index(values: list[int], disallowed: set[int] | None = None) -> int:
    """The first index of the smallest value, skipping ``disallowed``."""
    allowed = [i for i in range(len(values)) if not disallowed or i not in disallowed]
    if not allowed:
        raise AssertionError("All indices are disallowed")
    return min(allowed, key=lambda i: values[i])


def _assign_ddp_buckets(params_per_bucket: list[list[torch.Tensor]], world_size: int,
                        shard_buckets: bool) -> list[dict[int, _DDPBucketAssignment]]:
    """Which rank steps which part of each DDP bucket: ``result[rank][bucket_index]``.

    Whole buckets round robin (bucket ``i`` to rank ``i % world_size``), or with
    ``shard_buckets`` PyTorch's heuristic: buckets smallest first, each cut before the
    parameter that would bring a piece to ``total / world_size`` elements, every piece
    to the least loaded rank that holds no piece of that bucket yet."""
    result: list[dict[int, _DDPBucketAssignment]] = [{} for _ in range(world_size)]
    if not shard_buckets:
        for index, params in enumerate(params_per_bucket):
            result[index % world_size][index] = _DDPBucketAssignment(index, params, 0)
        return result
    threshold = sum(p.numel() for params in params_per_bucket for p in params) / world_size
    load = [0] * world_size
    for index, params in sorted(enumerate(params_per_bucket), key=lambda item: sum(p.numel() for p in item[1])):
        taken: set[int] = set()
        start, size = 0, 0
        for position, p in enumerate(params):
            if size + p.numel() >= threshold and position > start:
                rank = _min_index(load, taken)
                result[rank][index] = _DDPBucketAssignment(index, params[start:position], start)
                taken.add(rank)
                load[rank] += size
                start, size = position, 0
            size += p.numel()
        rank = _min_index(load, taken)  # the rest of the bucket: no piece spans two buckets
        result[rank][index] = _DDPBucketAssignment(index, params[start:], start)
        load[rank] += size
    return result


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wraps ``optimizer_class`` so that each rank holds the state of its share of ``params`` only."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], optimizer_class: type[Optimizer],
                 process_group: ProcessGroup | None = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults: Any) -> None:
        if not callable(optimizer_class):  # a class, or a factory (functools.partial), as in PyTorch
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass or a callable that makes "
                            f"one, got {optimizer_class!r}")
        if overlap_with_ddp and optimizer_class not in _OVERLAP_OPTIMIZERS:
            raise ValueError("Using `ddp_with_overlap=True` requires using a functional optimizer, but there is no "
                             f"supported functional optimizer equivalent for {optimizer_class}")
        self._initialized = False
        self._overlap_with_ddp = overlap_with_ddp
        self.process_group = process_group if process_group is not None else WORLD.require_default()
        self.world_size = self.process_group.size()
        self.rank = self.process_group.rank()
        self.global_rank = get_global_rank(self.process_group, self.rank)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._sizes = [0] * self.world_size
        self._rank_of: dict[int, int] = {}  # id(param) -> owning rank
        self._all_state_dicts: list[dict] = []
        self._buckets: list[torch.Tensor] = []
        params = _checked_params(params)
        Optimizer.__init__(self, params, defaults)  # calls add_param_group for each group
        Joinable.__init__(self)
        self._optimizer_class, self._optim_defaults = optimizer_class, defaults
        self._is_trainable_mask = self._trainable_mask()
        if overlap_with_ddp:
            self._init_overlap(parameters_as_bucket_view)
            return
        self.optim = optimizer_class(self._local_groups(), **defaults)
        self._initialized = True
        if parameters_as_bucket_view:
            self._build_param_buckets()
        # the local optimizer's groups hold its defaults too (weight_decay, ...): show them here
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    # -- overlap with DDP: initialization -----------------------------------------------------------
    def _init_overlap(self, parameters_as_bucket_view: bool) -> None:
        """``overlap_with_ddp``: no partition and no local optimizer until DDP's buckets are known."""
        if len(self.param_groups) != 1:  # PyTorch finds out at initialization, during a backward
            raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single "
                               "parameter group")
        self._overlap_info = _OverlapInfo(self.world_size)
        self._bucket_assignments_per_rank: list[dict[int, _DDPBucketAssignment]] = []
        if parameters_as_bucket_view:
            logger.warning("`parameters_as_bucket_view=True` will be ignored since `overlap_with_ddp=True`; "
                           "instead, a different bucketing strategy will be used")
        self._initialized = True

    def _init_zero_for_overlap(self) -> None:
        """Partition by DDP bucket, make each assignment's parameters views of one flat tensor,
        and build the local optimizer (called by the hook at the first bucket after recording)."""
        if not self._overlap_with_ddp:
            raise AssertionError("`_init_zero_for_overlap()` should only be called when `overlap_with_ddp=True`")
        info = self._overlap_info
        info.status = _OverlapStatus.INITIALIZED
        self._bucket_assignments_per_rank = _assign_ddp_buckets(info.params_per_bucket, self.world_size,
                                                                info.shard_buckets)
        info.assigned_ranks_per_bucket = [set() for _ in info.params_per_bucket]
        info.params_per_rank = [[] for _ in range(self.world_size)]
        for rank, assignments in enumerate(self._bucket_assignments_per_rank):
            for index in sorted(assignments):  # each rank's parameters in bucket order
                if rank == self.rank:
                    info.offsets[index] = len(info.params_per_rank[rank])
                info.params_per_rank[rank].extend(assignments[index].parameters)
                info.assigned_ranks_per_bucket[index].add(rank)
        info.num_bucket_assignments = sum(len(a) for a in self._bucket_assignments_per_rank)
        self._verify_params_per_rank(info.params_per_rank)
        for rank, params in enumerate(info.params_per_rank):
            for p in params:
                self._rank_of[id(p)] = rank
            self._sizes[rank] = sum(p.numel() for p in params)
        self._build_ddp_param_buckets()
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        self.optim = self._optimizer_class([{**group, "params": info.params_per_rank[self.rank]}],
                                           **self._optim_defaults)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        logger.debug("ZeroRedundancyOptimizer: rank %d steps %d parameters of %d DDP buckets (%d assignments)",
                     self.rank, len(info.params_per_rank[self.rank]), len(info.params_per_bucket),
                     info.num_bucket_assignments)

    def _verify_params_per_rank(self, params_per_rank: list[list[torch.Tensor]]) -> None:
        """Every parameter in DDP's buckets must be one of this optimizer's (PyTorch's check)."""
        if len(params_per_rank) != self.world_size:
            raise ValueError("`params_per_rank` must have length equal to the world size")
        known = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) not in known for params in params_per_rank for p in params):
            raise ValueError("Passing a new parameter in `params_per_rank` that was not passed into the "
                             "ZeroRedundancyOptimizer constructor")

    def _build_ddp_param_buckets(self) -> None:
        """Each bucket assignment's parameters become views of one flat tensor: the owner
        broadcasts that tensor after its step, one collective per assignment."""
        with torch.no_grad():
            for assignments in self._bucket_assignments_per_rank:
                for assignment in assignments.values():
                    params = assignment.parameters
                    if not all(p.requires_grad for p in params):
                        raise AssertionError("Model parameter corresponding to a gradient in a DDP bucket should "
                                             "require a gradient")
                    flat = torch.cat([p.detach().reshape(-1) for p in params])
                    offset = 0
                    for p in params:
                        p.data = flat[offset:offset + p.numel()].view_as(p)
                        offset += p.numel()
                    assignment.tensor = flat

    def _check_overlap_initialized(self) -> None:
        if self._overlap_with_ddp and self._overlap_info.status != _OverlapStatus.INITIALIZED:
            raise RuntimeError(_NOT_INITIALIZED)

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for g in self.param_groups for p in g["params"]]

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
        """Rank ``rank``'s parameters in its local optimizer's order."""
        if self._overlap_with_ddp:
            return list(self._overlap_info.params_per_rank[rank])
        return [p for g in self.param_groups for p in g["params"] if self._rank_of[id(p)] == rank]

    def add_param_group(self, param_group: dict) -> None:
        if self._initialized and self._overlap_with_ddp:
            raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single "
                               "parameter group")
        Optimizer.add_param_group(self, param_group)
        if self._overlap_with_ddp:
            return  # partitioned by DDP bucket, once the buckets are known
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
        """Step this rank's partition, then broadcast every partition from its owner.

        With ``overlap_with_ddp`` DDP's hook has stepped already: this only logs a
        warning and returns None, as PyTorch's does."""
        if self._overlap_with_ddp:
            logger.warning("`step()` should not be included in the training loop when `overlap_with_ddp=True`")
            return None
        Join.notify_join_context(self)
        self._sync_param_groups(self.param_groups, self.optim.param_groups)  # e.g. a scheduler changed lr
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        self._sync_params()
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _local_step(self, gradients: list[torch.Tensor | None]) -> None:
        """Overlap: step this rank's parameters with ``gradients`` (the local optimizer's order;
        None: leave that parameter alone), without broadcasting anything.

        ``.grad`` is swapped for the given gradients during the step and restored after it:
        the optimizers of ``_OVERLAP_OPTIMIZERS`` skip a parameter whose ``.grad`` is None,
        and DDP writes the reduced gradients to ``.grad`` itself once backward ends."""
        if self._trainable_mask() != self._is_trainable_mask:
            raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` does not support changing "
                               "parameter trainability at run time")
        params = self.optim.param_groups[0]["params"]
        if len(gradients) != len(params):
            raise AssertionError(f"{len(gradients)} gradients for {len(params)} local parameters")
        self._sync_param_groups(self.param_groups, self.optim.param_groups)  # e.g. a scheduler changed lr
        saved = [p.grad for p in params]
        try:
            for p, grad in zip(params, gradients):
                p.grad = grad
            self.optim.step()
        finally:
            for p, grad in zip(params, saved):
                p.grad = grad
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    def _sync_params(self) -> None:
        for rank in range(self.world_size):
            params = self._params_of(rank)
            if params:
                broadcast_coalesced(params, rank, self.process_group)

    # -- state dicts ----------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state on group rank ``to``; call it on every rank."""
        self._check_overlap_initialized()
        self._sync_param_groups(self.param_groups, self.optim.param_groups)  # e.g. a scheduler changed lr
        local = self.optim.state_dict()
        gathered: list | None = [None] * self.world_size if self.rank == to else None
        gather_object(local, gathered, group=self.process_group, group_dst=to)
        self._all_state_dicts = gathered if gathered is not None else []

    def state_dict(self) -> dict[str, Any]:
        """The full state in the plain optimizer's format; only on the rank given to consolidate_state_dict."""
        self._check_overlap_initialized()
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant to save the global "
                "state.")
        global_index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict[int, Any] = {}
        for rank, local in enumerate(self._all_state_dicts):
            # the local optimizer numbers its parameters in its own order
            for local_index, p in enumerate(self._params_of(rank)):
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
        self._check_overlap_initialized()
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(state_dict['param_groups'])} parameter groups, the "
                             f"optimizer has {len(self.param_groups)}")
        saved_index: dict[int, int] = {}  # id(param) -> its index in state_dict
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"loaded parameter group has {len(saved['params'])} parameters, the optimizer's "
                                 f"has {len(group['params'])}")
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
            saved_index.update((id(p), index) for p, index in zip(group["params"], saved["params"]))
        # the local optimizer's numbering: its parameters in its own order
        local_index = {id(p): i for i, p in enumerate(self._params_of(self.rank))}
        local_state = {local_index[id(p)]: state_dict["state"][saved_index[id(p)]]
                       for p in self._params_of(self.rank) if saved_index[id(p)] in state_dict["state"]}
        local_groups = []
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            entry = {k: v for k, v in saved.items() if k != "params"}
            entry["params"] = sorted(local_index[id(p)] for p in group["params"] if id(p) in local_index)
            local_groups.append(entry)
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
