"""What an algorithm sees: its rank, the group size, and send/recv/wait for one op.

:class:`Comm` binds a :class:`~torchdist._transport.base.Transport` to one
collective: every message it sends carries the op's sequence number and
fingerprint, every receive it posts expects them. Algorithms post the sends and
receives of a step, then ``wait`` for them together; the transport progresses
all of them at once, which is what makes "send right, receive left" safe.

Also here: zero-copy byte views of tensors and the chunking of a flat buffer
(``chunk_bounds``, ``gather_pieces``).

Cost model used in the algorithm docstrings (Hockney's alpha-beta): sending
``n`` bytes costs ``alpha + n * beta``; ``gamma`` is the per-byte reduction cost;
``p`` is the group size.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .._transport.base import EMPTY, Transfer, Transport
from .._transport.framing import MsgKind, OpFingerprint

__all__ = ["Comm", "Scratch", "byte_view", "copy_into", "chunk_bounds", "gather_pieces", "flatten", "unflatten_into"]


#: Below this many bytes ``copy_into`` is ``Tensor.copy_``: the same speed, and no
#: contiguity checks to pay for.
_MEMMOVE_MIN = 64 << 10


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; between contiguous tensors of one dtype and size, one ``memmove``.

    glibc's ``memmove`` copies large blocks with ``rep movsb``, which can write
    whole cache lines without reading them first; torch's copy kernel reads every
    destination line before writing it. That pays when the destination is cold, as
    a caller's tensor receiving a large collective's result is. Measured on the
    2-core VM, copying the results out of shared memory: a 64 MiB broadcast 9.0-9.2
    ms instead of 11.2-11.4 ms at world 2, all-gather 5-10% faster. Into memory a
    peer reads next it is slower (see ``shm_direct``). Like any ctypes call it
    releases the GIL.
    """
    nbytes = dst.nbytes
    if (nbytes < _MEMMOVE_MIN or src.dtype != dst.dtype or src.numel() != dst.numel()
            or not (dst.is_contiguous() and src.is_contiguous())):
        dst.copy_(src)
        return
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of ``tensors``' elements, in order (coalesced ops run on it); a
    flat view of the tensor itself when there is only one and it is contiguous."""
    return tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` (from :func:`flatten`) back into ``tensors``."""
    if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr():
        return  # flatten's view of the one tensor: the results are already in place
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable, format 'B').

    The view keeps the tensor (hence its storage) alive: the ctypes array it is
    made from holds a reference, so a transfer can never write to freed memory.
    """
    nbytes = tensor.nbytes
    if nbytes == 0:
        return EMPTY
    array = _array_type(nbytes).from_address(tensor.data_ptr())
    array.tensor = tensor
    return memoryview(array).cast("B")


@functools.lru_cache(maxsize=256)
def _array_type(nbytes: int) -> type:
    # Creating a ctypes array type costs microseconds; ops reuse a few sizes.
    return ctypes.c_ubyte * nbytes


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(numel)`` into ``parts`` contiguous (start, stop) chunks, sizes
    differing by at most one (the first ``numel % parts`` are one longer)."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def gather_pieces(output: torch.Tensor, input: torch.Tensor, size: int, rank: int) -> list[torch.Tensor]:
    """An all-gather into one flat ``output`` as the per-rank pieces of ``allgather``:
    rank j's piece at ``j * input.numel()``, this rank's filled with ``input``."""
    n = input.numel()
    pieces = [output[j * n:(j + 1) * n] for j in range(size)]
    pieces[rank].copy_(input)
    return pieces


class Scratch:
    """A buffer reused by successive ops of one group (they never overlap: the
    engine runs one op at a time). Fresh large buffers cost page faults on every
    op; measured at 64 MiB that was a third of the all-reduce time. Up to
    ``KEEP_BYTES`` it is kept between ops (and released with the group); a larger
    op gets one of its own, so that one huge op does not pin its size for good."""

    __slots__ = ("buffer",)
    KEEP_BYTES = 64 << 20

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        esize = torch.empty(0, dtype=dtype).element_size()
        nbytes = numel * esize
        if nbytes > self.KEEP_BYTES:
            return torch.empty(numel, dtype=dtype)
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer[:nbytes].view(dtype)

    def release(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)


class Comm:
    """One collective's view of the transport: ``rank``, ``size``, send/recv/wait,
    and ``scratch(numel, dtype)``: temporary memory valid until the op returns."""

    __slots__ = ("transport", "rank", "size", "seq", "fingerprint", "deadline", "_scratch")

    def __init__(self, transport: Transport, seq: int, fingerprint: OpFingerprint,
                 deadline: float | None, scratch: Scratch | None = None) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.size
        self.seq = seq
        self.fingerprint = fingerprint
        self.deadline = deadline
        self._scratch = scratch

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of scratch; one call per op (a second call reuses the memory)."""
        if self._scratch is None:
            return torch.empty(numel, dtype=dtype)
        return self._scratch.get(numel, dtype)

    def send(self, peer: int, data: torch.Tensor | memoryview) -> Transfer:
        view = data if isinstance(data, memoryview) else byte_view(data)
        return self.transport.isend(peer, MsgKind.COLL, self.seq, self.fingerprint, view)

    def recv(self, peer: int, into: torch.Tensor | memoryview, on_data=None) -> Transfer:
        view = into if isinstance(into, memoryview) else byte_view(into)
        return self.transport.irecv(peer, MsgKind.COLL, self.seq, self.fingerprint, view,
                                    on_data=on_data)

    def wait(self, *transfers: Transfer) -> None:
        self.transport.wait(transfers, self.deadline)

    def exchange(self, send_to: int, send: torch.Tensor, recv_from: int, into: torch.Tensor,
                 on_data=None) -> None:
        """One step: send ``send`` to one peer while receiving ``into`` from another."""
        receive = self.recv(recv_from, into, on_data)
        self.wait(self.send(send_to, send), receive)
