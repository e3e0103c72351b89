"""Argument handling shared by every c10d function: groups, roots, dtypes, staging.

Each public function resolves its group (warning and returning None on
non-members, as PyTorch does), turns root arguments (global ``src``/``dst`` or
group ``group_src``/``group_dst``) into a group rank, checks dtypes and sizes
before anything is sent, and hands the backend contiguous tensors: a
non-contiguous output is replaced by a contiguous copy (a *stage*) whose result is
copied back when the op completes, so strided slices come out right.
"""

from __future__ import annotations

import threading
import warnings
from datetime import timedelta
from typing import Iterable

import torch

from .._process_group.process_group import ProcessGroup
from .._process_group.work import Work
from .comm_report import report_c10d
from .world import NON_GROUP_MEMBER, WORLD


def member_group(group: ProcessGroup | None, op: str, refuse: bool = False) -> ProcessGroup | None:
    """The group to run ``op`` on, or None (after a warning) if this rank is not in it.

    A collective that will run is reported to ``comm_report``'s listeners (CommDebugMode) here.

    ``refuse``: raise ValueError instead, as PyTorch's ``send``, ``send_object_list`` and
    ``recv_object_list`` do on a rank outside their group."""
    pg = WORLD.resolve(group)
    if pg is NON_GROUP_MEMBER:
        rank = WORLD.require_default().rank()
        if refuse:
            raise ValueError(f"{op}: Invalid process group specified: rank {rank} is not in the group")
        warnings.warn(
            f"Running {op} on global rank {rank} which does not belong to the given group.",
            UserWarning,
            stacklevel=3,
        )
        return None
    report_c10d(op)
    return pg


def group_root(
    pg: ProcessGroup, op: str, global_rank: int | None, group_rank: int | None, default: int | None = None
) -> int:
    """The group rank named by exactly one of ``global_rank``/``group_rank``.

    ``default`` (a global rank) applies when neither is given; without one, a root is required.
    """
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"{op}: Can't specify both group_rank and global_rank")
    if global_rank is None and group_rank is None:
        if default is None:
            raise ValueError(f"{op}: Must specify global_rank or group_rank (e.g. src=0)")
        global_rank = default
    given = group_rank if group_rank is not None else global_rank
    if not isinstance(given, int):
        raise TypeError(f"{op}: a root rank is an int, got {type(given).__name__} {given!r}")
    if group_rank is not None:
        if not 0 <= group_rank < pg.size():
            raise RuntimeError(f"{op}: invalid root rank: group rank {group_rank} is not in 0..{pg.size() - 1}")
        return int(group_rank)
    if pg is WORLD.require_default() and not 0 <= global_rank < pg.size():
        raise RuntimeError(f"{op}: invalid root rank: {global_rank} is not in 0..{pg.size() - 1}")
    return WORLD.group_rank(pg, int(global_rank))  # ValueError for a rank outside a subgroup, as PyTorch


_TAG_LIMIT = 1 << 31  # tags are C ints in PyTorch's bindings


def check_tag(op: str, tag: object) -> int:
    """A P2P tag as PyTorch takes it: an int that fits a C int (a TypeError from its
    argument parsing otherwise), not negative (gloo's RuntimeError). Negative tags
    are torchdist's own (``monitored_barrier``'s messages)."""
    if not isinstance(tag, int) or not -_TAG_LIMIT <= tag < _TAG_LIMIT:
        raise TypeError(f"{op}(): incompatible function arguments: tag must be an int below {_TAG_LIMIT}, "
                        f"got {type(tag).__name__} {tag!r}")
    if tag < 0:
        raise RuntimeError(f"{op}: Tag must be nonnegative, got {tag}")
    return int(tag)


def check_timeout(timeout: timedelta | None) -> None:
    """PyTorch's group constructors take a ``timedelta`` (or None), nothing else."""
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got {timeout!r}")


def check_tensor(op: str, tensor: object, name: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:  # not tensor.device.type: that builds a device object (~0.3 us)
        raise ValueError(f"{op}: {name} is on {tensor.device}; torchdist's CPU backends take CPU tensors")
    if tensor.is_sparse:
        raise ValueError(f"{op}: sparse tensors are not supported; pass tensor.to_dense()")
    return tensor


def check_same_dtype(op: str, tensors: Iterable[torch.Tensor], error: type[Exception] = ValueError) -> None:
    """``error``: PyTorch's type for this op (ValueError where its Python layer checks,
    RuntimeError where only its C++ backend does)."""
    dtype = None
    for t in tensors:
        check_tensor(op, t)
        if dtype is None:
            dtype = t.dtype
        elif t.dtype != dtype:
            raise error(f"{op}: Invalid usage of tensors with different dtypes. Found {dtype} and {t.dtype}")


def check_list(op: str, tensors: object, size: int, name: str) -> list[torch.Tensor]:
    """A list of one tensor per rank; a wrong length is PyTorch's backend error (RuntimeError)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != size:
        raise RuntimeError(f"{op}: {name} has {len(tensors)} tensors; it must have one per rank ({size})")
    return list(tensors)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``t`` may touch: [first, last + 1)."""
    start = t.storage_offset() * t.element_size()
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))  # strides are >= 0
    return start, start + (extent + 1) * t.element_size()


def read_apart(tensor: torch.Tensor, outputs: list[torch.Tensor], own: int | None = None) -> torch.Tensor:
    """``tensor``, cloned if it shares memory with any of ``outputs`` except ``outputs[own]``.

    PyTorch's ops read every input before they write an output. Ours receive into an
    output while an input over the same memory may still be waiting to be sent, so an
    input aliasing an output (``all_to_all(xs, xs)``) is read from a copy. ``own``: the
    output that may be the input itself because the op only copies one into the other.
    On the path of every small op: one storage lookup per tensor unless storages match.
    """
    if not tensor.numel():
        return tensor
    storage = tensor.untyped_storage().data_ptr()
    for i, out in enumerate(outputs):
        if i != own and out.untyped_storage().data_ptr() == storage and out.numel():
            (a0, a1), (b0, b1) = _byte_span(tensor), _byte_span(out)
            if a0 < b1 and b0 < a1:
                return tensor.clone()
    return tensor


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a plain tensor, outside autograd and inference mode.

    PyTorch's collectives are C++ ops that write through the tensor's pointer: they
    write parameters (leaves that require grad) and inference tensors in place, and
    leave the version counter alone, so a tensor of the graph saved for backward and
    then all-reduced still backpropagates. Ours are torch ops, which would refuse
    the first two and bump the counter. So a tensor gets ``.data``, an alias with a
    counter of its own that accepts writes (even one that does not require grad may
    have been saved for backward: ``x * w`` saves ``w``). An inference tensor's
    ``.data`` is one too, but its views refuse writes, so it gets a fresh tensor
    over the same storage.
    """
    if tensor.is_inference():
        return torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage(), tensor.storage_offset(),
                                                       tensor.size(), tensor.stride())
    return tensor.data


class Staging:
    """Contiguous stand-ins for the caller's tensors, and the copies back after the op.

    Complex tensors travel as their real view (``view_as_real``), so backends only
    ever see real dtypes; every tensor is ``plain``.
    """

    def __init__(self) -> None:
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._callers: dict[int, torch.Tensor] | None = None  # id of what the backend writes -> the caller's

    @staticmethod
    def _wire(tensor: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(tensor) if tensor.is_complex() else tensor

    def input(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor the op only reads. A conjugate or negative view (``x.conj()``,
        ``x.conj().imag``) is a flag over unchanged memory: it is resolved first."""
        return self._wire(plain(tensor).resolve_conj().resolve_neg().contiguous())

    def output(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor the op writes (and may read first, for in-place ops)."""
        caller, tensor = tensor, plain(tensor)
        if tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
            wire = self._wire(tensor)
        else:
            stage = tensor.resolve_conj().resolve_neg().contiguous()
            self._copy_back.append((tensor, stage))
            wire = self._wire(stage)
        if wire is not caller:
            if self._callers is None:
                self._callers = {}
            self._callers[id(wire)] = caller
        return wire

    def finish(self, work: Work, async_op: bool, result: list[torch.Tensor] | None = None) -> Work | None:
        """Attach the copies back to ``work``; wait for it unless ``async_op``. ``result``:
        what ``work.result()`` and its future hold, where PyTorch's choice for the op is
        not the tensors the backend wrote (views of the caller's tensors)."""
        if self._copy_back:
            copies = self._copy_back

            def copy_back(done: Work) -> None:
                if done.is_success():
                    for target, stage in copies:
                        target.copy_(stage)

            work._on_done(copy_back)
        if async_op:
            if result is not None:
                work._outputs = result
            elif self._callers is not None:  # the result is the caller's tensors, as PyTorch's
                work._outputs = [self._callers.get(id(t), t) for t in work._outputs]
            return work
        work.wait()
        return None


class _AllOf(Work):
    """A Work made of parts; waiting on it waits on each part, which lets the waiting
    thread run parts still queued (a small synchronous op runs when waited on)."""

    def __init__(self, op: str, parts: list[Work], outputs: list) -> None:
        super().__init__(op, outputs)
        self._parts = parts

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        for part in self._parts:
            if part.exception() is None:
                part.wait(timeout)
        return super().wait(timeout)


def all_of(op: str, works: list[Work], outputs: list) -> Work:
    """One Work that completes when every one of ``works`` has, failing with the first error."""
    combined = _AllOf(op, works, outputs)
    remaining = [len(works)]
    lock = threading.Lock()  # parts may complete on the caller's thread and the engine's

    def on_done(done: Work) -> None:
        if done.exception() is not None:
            combined._fail(done.exception())
            return
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            combined._complete()

    if not works:
        combined._complete()
    for work in works:
        work._on_done(on_done)
    return combined
