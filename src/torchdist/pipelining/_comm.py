"""How stages talk: tensors by ``isend``/``irecv`` on the pipeline group; the set-up's small objects pickled into
tensors on tags of their own (above every tensor tag), so they never meet a tensor message.

Every tensor message has its own tag, derived from (direction, sending stage,
microbatch, argument index), so messages between two ranks can never be
matched out of order, whatever order the two ranks' schedules post them in.
Failures of the transport (a dead peer, the group timeout, a size mismatch)
are re-raised with the stage, the microbatch and the peer named.
"""

from __future__ import annotations

from typing import Any, Callable

import pickle

import torch

from .._c10d.p2p import irecv, isend
from .._process_group.process_group import ProcessGroup
from .._process_group.work import Work

__all__ = ["FORWARD", "BACKWARD", "tag_of", "send_tensors", "recv_tensors", "send_object", "recv_object",
           "failed", "wait_all"]

FORWARD, BACKWARD = 0, 1
_MAX_ARGS = 1024  # tensors per message direction; more than any stage boundary carries
_OBJECT_TAG = 1 << 30  # tags of metadata messages; tensor tags stay below


def tag_of(direction: int, stage: int, microbatch: int, index: int, num_stages: int) -> int:
    """The tag of one tensor: unique per (direction, sending stage, microbatch, argument) within a step."""
    if index >= _MAX_ARGS:
        raise ValueError(f"pipelining: a stage boundary carries at most {_MAX_ARGS} tensors, got index {index}")
    tag = 1 + ((microbatch * num_stages + stage) * 2 + direction) * _MAX_ARGS + index
    if tag >= _OBJECT_TAG:
        raise ValueError(f"pipelining: {num_stages} stages x {microbatch + 1} microbatches exceed the tag space")
    return tag


def failed(exc: BaseException, what: str) -> BaseException:
    """``exc`` re-made with ``what`` (which stage did what) in front, of the same type where it can be."""
    message = f"{what}: {exc}"
    try:
        new = type(exc)(message)
    except Exception:  # noqa: BLE001 - an exception type with another constructor: fall back to RuntimeError
        new = RuntimeError(message)
    new.__cause__ = exc
    return new


def wait_all(works: list[Work], what: Callable[[], str]) -> None:
    for work in works:
        try:
            work.wait()
        except Exception as exc:
            raise failed(exc, what()) from exc


def send_tensors(tensors: list[tuple[int, torch.Tensor]], peer: int, group: ProcessGroup | None,
                 direction: int, stage: int, microbatch: int, num_stages: int) -> list[Work]:
    """Start sending each (argument index, tensor) to group rank ``peer``; returns the Works."""
    works = []
    for index, tensor in tensors:
        tag = tag_of(direction, stage, microbatch, index, num_stages)
        work = isend(tensor.detach().contiguous(), group=group, group_dst=peer, tag=tag)
        if work is not None:
            works.append(work)
    return works


def recv_tensors(buffers: list[tuple[int, torch.Tensor]], peer: int, group: ProcessGroup | None,
                 direction: int, sender_stage: int, microbatch: int, num_stages: int) -> list[Work]:
    """Start receiving into each (argument index, buffer) from group rank ``peer``; returns the Works."""
    works = []
    for index, buffer in buffers:
        tag = tag_of(direction, sender_stage, microbatch, index, num_stages)
        work = irecv(buffer, group=group, group_src=peer, tag=tag)
        if work is not None:
            works.append(work)
    return works


def send_object(obj: Any, peer: int, group: ProcessGroup | None, tag: int) -> list[Work]:
    """Start sending a picklable object (stage metadata) to group rank ``peer``: its length, then its bytes."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    works = [isend(torch.tensor([payload.numel()]), group=group, group_dst=peer, tag=_OBJECT_TAG + tag),
             isend(payload, group=group, group_dst=peer, tag=_OBJECT_TAG + tag)]
    return [w for w in works if w is not None]


def recv_object(peer: int, group: ProcessGroup | None, tag: int, what: Callable[[], str]) -> Any:
    """Receive what ``send_object`` sent from group rank ``peer`` with the same tag."""
    size = torch.zeros(1, dtype=torch.long)
    wait_all([irecv(size, group=group, group_src=peer, tag=_OBJECT_TAG + tag)], what)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    wait_all([irecv(payload, group=group, group_src=peer, tag=_OBJECT_TAG + tag)], what)
    return pickle.loads(payload.numpy().tobytes())
