"""Collectives of picklable Python objects, built on the tensor collectives.

Each object travels as its pickle in a uint8 tensor, preceded by a collective of
the byte counts so receivers can size their buffers (PyTorch's scheme). The object
path is kept apart from the buffer path: nothing here touches a backend directly.

Unpickling runs code chosen by the sender: only use these with peers you trust.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .._process_group.process_group import ProcessGroup
from . import collectives, p2p
from ._args import group_root, member_group

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]


def _to_tensor(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    pickle.Pickler(buffer).dump(obj)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def _from_tensor(tensor: torch.Tensor, size: int) -> Any:
    return pickle.Unpickler(io.BytesIO(tensor[:size].numpy().tobytes())).load()


def _sizes(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.numel() for t in tensors], dtype=torch.long)


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: ProcessGroup | None = None,
                          device=None, group_src: int | None = None) -> None:
    """Replace ``object_list``'s entries on every rank with the root's, in place."""
    pg = member_group(group, "broadcast_object_list")
    if pg is None:
        return
    root = group_root(pg, "broadcast_object_list", src, group_src, default=0 if group_src is None else None)
    sizes = torch.zeros(len(object_list), dtype=torch.long)
    if pg.rank() == root:
        tensors = [_to_tensor(obj) for obj in object_list]
        sizes = _sizes(tensors)
        payload = torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.uint8)
    collectives.broadcast(sizes, group=pg, group_src=root)
    if pg.rank() != root:
        payload = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    collectives.broadcast(payload, group=pg, group_src=root)
    if pg.rank() != root:
        offset = 0
        for i, size in enumerate(sizes.tolist()):
            object_list[i] = _from_tensor(payload[offset:], size)
            offset += size


def _all_gather_padded(tensor: torch.Tensor, pg) -> tuple[list[torch.Tensor], list[int], torch.Tensor]:
    """Prepare to all-gather byte tensors of different lengths: share the lengths, pad to the longest.

    Returns (output buffers, every rank's length, this rank's padded tensor).
    """
    local_size = torch.tensor([tensor.numel()], dtype=torch.long)
    all_sizes = [torch.zeros(1, dtype=torch.long) for _ in range(pg.size())]
    collectives.all_gather(all_sizes, local_size, group=pg)
    sizes = [int(s) for s in all_sizes]
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: tensor.numel()] = tensor
    outputs = [torch.empty(longest, dtype=torch.uint8) for _ in range(pg.size())]
    return outputs, sizes, padded


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """``object_list[i]`` receives rank i's ``obj``."""
    pg = member_group(group, "all_gather_object")
    if pg is None:
        return
    outputs, sizes, padded = _all_gather_padded(_to_tensor(obj), pg)
    collectives.all_gather(outputs, padded, group=pg)
    _fill("all_gather_object", object_list, outputs, sizes)


def _fill(op: str, objects: list[Any], outputs: list[torch.Tensor], sizes: list[int]) -> None:
    """``objects[i]`` = rank i's object, as PyTorch: after the collective (so the other
    ranks complete), entries past the group size untouched, a short list an IndexError."""
    for i, (tensor, size) in enumerate(zip(outputs, sizes)):
        if i >= len(objects):
            raise IndexError(f"{op}: the object list has {len(objects)} entries, but the group has {len(outputs)} "
                             f"ranks; rank {i}'s object has no place")
        objects[i] = _from_tensor(tensor, size)


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: ProcessGroup | None = None, group_dst: int | None = None) -> None:
    """The root's ``object_gather_list[i]`` receives rank i's ``obj`` (root: ``dst``, default 0)."""
    pg = member_group(group, "gather_object")
    if pg is None:
        return
    root = group_root(pg, "gather_object", dst, group_dst, default=0 if group_dst is None else None)
    if pg.rank() == root and not object_gather_list:
        raise ValueError("gather_object: Argument ``gather_list`` must be specified on destination rank.")
    if pg.rank() != root and object_gather_list:
        raise ValueError("gather_object: Argument ``gather_list`` must NOT be specified on non-destination ranks.")
    outputs, sizes, padded = _all_gather_padded(_to_tensor(obj), pg)
    collectives.gather(padded, outputs if pg.rank() == root else None, group=pg, group_dst=root)
    if pg.rank() == root:
        _fill("gather_object", object_gather_list, outputs, sizes)


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: ProcessGroup | None = None,
                        group_src: int | None = None) -> None:
    """Rank i's ``scatter_object_output_list[0]`` receives the root's ``scatter_object_input_list[i]``."""
    pg = member_group(group, "scatter_object_list")
    if pg is None:
        return
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("Expected argument scatter_object_output_list to be a list of size at least 1.")
    root = group_root(pg, "scatter_object_list", src, group_src, default=0 if group_src is None else None)
    longest = torch.zeros(1, dtype=torch.long)
    if pg.rank() == root:
        if not scatter_object_input_list:
            raise ValueError("scatter_object_list: the source rank must provide scatter_object_input_list")
        if len(scatter_object_input_list) != pg.size():
            raise RuntimeError(f"scatter_object_list: Incorrect input list size {len(scatter_object_input_list)}. "
                               f"Input list size should be {pg.size()}, one object per rank")
        tensors = [_to_tensor(obj) for obj in scatter_object_input_list]
        sizes = _sizes(tensors)
        longest[0] = int(sizes.max())
    collectives.broadcast(longest, group=pg, group_src=root)
    received = torch.empty(int(longest), dtype=torch.uint8)
    received_size = torch.zeros(1, dtype=torch.long)
    if pg.rank() == root:
        padded = [torch.cat([t, torch.zeros(int(longest) - t.numel(), dtype=torch.uint8)]) for t in tensors]
        collectives.scatter(received, padded, group=pg, group_src=root)
        collectives.scatter(received_size, [s.reshape(1) for s in sizes], group=pg, group_src=root)
    else:
        collectives.scatter(received, None, group=pg, group_src=root)
        collectives.scatter(received_size, None, group=pg, group_src=root)
    scatter_object_output_list[0] = _from_tensor(received, int(received_size))


def send_object_list(object_list: list[Any], dst: int | None = None, group: ProcessGroup | None = None, device=None,
                     group_dst: int | None = None, use_batch: bool = False) -> None:
    """Send the objects of ``object_list`` to ``dst``, which calls ``recv_object_list``."""
    pg = member_group(group, "send_object_list", refuse=True)
    tensors = [_to_tensor(obj) for obj in object_list]
    p2p.send(_sizes(tensors), dst, pg, group_dst=group_dst)
    p2p.send(torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.uint8), dst, pg, group_dst=group_dst)


def recv_object_list(object_list: list[Any], src: int | None = None, group: ProcessGroup | None = None, device=None,
                     group_src: int | None = None, use_batch: bool = False) -> int:
    """Fill ``object_list`` with the objects a peer sent; returns the sender's rank."""
    pg = member_group(group, "recv_object_list", refuse=True)
    peer = group_root(pg, "recv_object_list", src, group_src)  # no any-source receive here, as in PyTorch
    if peer == pg.rank():
        raise ValueError("recv_object_list: Invalid source rank: source rank should not be the same as the rank of "
                         "the current process.")
    sizes = torch.zeros(len(object_list), dtype=torch.long)
    sender = p2p.recv(sizes, group=pg, group_src=peer)
    payload = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    p2p.recv(payload, group=pg, group_src=peer)
    sizes = sizes.tolist()
    if 0 in sizes:  # a pickle is never empty: the sender sent fewer objects than the list holds
        raise RuntimeError(
            f"recv_object_list: rank {pg.rank()} received {sizes.index(0)} objects from rank {peer} into a list of "
            f"{len(object_list)}; object_list must be as long as the sender's (it is left as it was)")
    received, offset = [], 0
    for size in sizes:  # all unpickled before any is stored: a failure leaves object_list as it was
        received.append(_from_tensor(payload[offset:], size))
        offset += size
    object_list[:len(received)] = received
    return sender
