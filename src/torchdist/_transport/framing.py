"""The wire format: one fixed 48-byte header in front of every message.

Vocabulary (used by every transport and by the algorithms):

- *message*: one header plus ``nbytes`` of payload, sent to one peer;
- *kind*: COLL (part of a collective), P2P (a send/recv), ABORT (the sender's
  group is broken; the payload is the UTF-8 reason), and the notices WAITING and
  LEFT (see ``MsgKind``);
- *seq*: the group's collective sequence number (how many collectives the group
  ran before this one). P2P messages carry the seq current when they were sent
  but are not checked against it: point-to-point does not take part in
  collective numbering;
- *fingerprint*: what the sender believes the op is (op kind, dtype, element
  count, root, reduce op). Receivers compare it with their own, so ranks that
  disagree about the op are caught on the first message, at no extra round trip.

Header layout (little endian, 48 bytes)::

    offset  size  field
         0     1  kind          MsgKind
         1     1  op            OpKind of the sender's collective (0 for P2P/ABORT)
         2     1  dtype         index into DTYPES (255 = none)
         3     1  reduce op     RedOpType value (255 = none)
         4     4  root          group rank of the root, -1 if the op has none
         8     8  seq           collective sequence number
        16     8  tag           P2P tag (0 for collectives)
        24     8  numel         element count of the sender's op (-1 = not checked)
        32     8  nbytes        payload length that follows the header
        40     8  reserved      0

Collective messages from one peer arrive in the order they were sent (one
ordered stream per peer), so a receiver matches each one to the oldest
collective receive it posted for that peer, then checks seq and fingerprint.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["MsgKind", "OpKind", "OpFingerprint", "Header", "HEADER", "DTYPES", "dtype_code", "wire_key"]


class MsgKind(enum.IntEnum):
    COLL = 1
    P2P = 2
    ABORT = 3
    #: A rank timed out in collective ``seq``: the payload lists the ranks it waits on
    #: (int32 group ranks). Sent only on that slow path (``waits.py``: TCP and MPI).
    WAITING = 4
    #: The sender closed its transport; the payload says how many messages it sent us
    #: (``MpiTransport``, whose peers see no hang-up).
    LEFT = 5


class OpKind(enum.IntEnum):
    """The collective a message belongs to; names as PyTorch's OpType prints them."""

    NONE = 0
    BROADCAST = 1
    ALLREDUCE = 2
    REDUCE = 3
    ALLGATHER = 4
    ALLGATHER_INTO_TENSOR = 5
    GATHER = 6
    SCATTER = 7
    REDUCE_SCATTER = 8
    REDUCE_SCATTER_TENSOR = 9
    ALLTOALL = 10
    BARRIER = 11
    ALLREDUCE_COALESCED = 12


#: Every dtype that can travel; the header carries its index.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
    torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2,
)
_DTYPE_INDEX = {dtype: index for index, dtype in enumerate(DTYPES)}
_NONE = 255
#: RedOpType names by value, for messages (the transport layer does not import the
#: process-group layer above it).
_REDOP_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")


def dtype_code(dtype: torch.dtype | None) -> int:
    if dtype is None:
        return _NONE
    try:
        return _DTYPE_INDEX[dtype]
    except KeyError:
        # RuntimeError, as PyTorch's backends refuse a dtype they cannot move
        raise RuntimeError(f"dtype {dtype} cannot be communicated; supported: {list(DTYPES)}") from None


class OpFingerprint(NamedTuple):
    """What an op is, as every rank must agree: kind, dtype, element count, root, reduce op.

    A tuple, because it is compared for every message received."""

    op: int = OpKind.NONE
    dtype: int = _NONE
    numel: int = -1
    root: int = -1
    redop: int = _NONE

    @classmethod
    def of(cls, op: OpKind, dtype: torch.dtype | None = None, numel: int = -1,
           root: int = -1, redop: int | None = None) -> "OpFingerprint":
        return cls(int(op), dtype_code(dtype), numel, root, _NONE if redop is None else int(redop))

    def describe(self) -> str:
        """E.g. ``ALLREDUCE(dtype=torch.float32, numel=4, op=SUM)``."""
        parts = []
        if self.dtype != _NONE:
            parts.append(f"dtype={DTYPES[self.dtype] if self.dtype < len(DTYPES) else self.dtype}")
        if self.numel >= 0:
            parts.append(f"numel={self.numel}")
        if self.root >= 0:
            parts.append(f"root={self.root}")
        if self.redop != _NONE:
            name = _REDOP_NAMES[self.redop] if self.redop < len(_REDOP_NAMES) else str(self.redop)
            parts.append(f"op={name}")
        try:
            kind = OpKind(self.op).name
        except ValueError:
            kind = f"op{self.op}"
        return f"{kind}({', '.join(parts)})"


def wire_key(kind: int, seq: int, tag: int, nbytes: int, fp: OpFingerprint) -> tuple:
    """The first nine header fields, in wire order: what a receive expects to see."""
    return (kind, fp.op, fp.dtype, fp.redop, fp.root, seq, tag, fp.numel, nbytes)


#: kind, op, dtype, redop, root, seq, tag, numel, nbytes, reserved
HEADER = struct.Struct("<BBBBiqqqqq")
assert HEADER.size == 48


@dataclass(frozen=True)
class Header:
    """A decoded header; ``pack()`` gives the 48 wire bytes."""

    kind: MsgKind
    seq: int
    nbytes: int
    fingerprint: OpFingerprint = OpFingerprint()
    tag: int = 0

    def pack(self) -> bytes:
        fp = self.fingerprint
        return HEADER.pack(self.kind, fp.op, fp.dtype, fp.redop, fp.root, self.seq, self.tag,
                           fp.numel, self.nbytes, 0)

    @classmethod
    def from_fields(cls, fields: tuple) -> "Header":
        """Decode ``HEADER.unpack`` output (or a ``wire_key``): used on error paths only."""
        kind, op, dtype, redop, root, seq, tag, numel, nbytes = fields[:9]
        try:
            msg_kind = MsgKind(kind)
        except ValueError:
            raise ValueError(f"corrupt message header (kind={kind}, op={op}): the stream is out of sync") from None
        return cls(msg_kind, seq, nbytes, OpFingerprint(op, dtype, numel, root, redop), tag)
