"""The TCPStore wire protocol: framing, message types and replies, shared by client and server.

Framing
-------
Every message, in both directions, is one *frame*::

    u32 length | u8 code | body          (little-endian; length = 1 + len(body))

``code`` is the request's :class:`Op` from a client, the reply's :class:`Status`
from the server. ``length`` is capped at :data:`MAX_FRAME` (64 MiB): a store
carries addresses and counters, not tensors, and the cap bounds what one peer can
make the server buffer. A peer announcing a longer frame is disconnected at once,
before its body arrives. Inside a body, a *string* is ``u32 n | n bytes``, a *key
list* is ``u32 count | string*``, an *int* is ``i64``, and the last field of a body
takes the rest of the frame without a length.

Handshake
---------
A connection opens with ``HELLO``: ``u32 MAGIC | u32 VERSION | u64 nonce``. The
server answers ``OK`` with the same three fields; the client checks them all, so it
knows it reached a torchdist store of its protocol version. Until the handshake is
over both sides accept only frames of at most :data:`HANDSHAKE_MAX` bytes, and the
server wants a 17-byte ``HELLO`` first: a client speaking another protocol (HTTP, a
torch.distributed store) is dropped as soon as its first four bytes arrive. A
version mismatch is answered ``ERROR`` with a message, then closed.

A server started with the job secret (``secret=`` or ``$TORCHDIST_SECRET``) then
wants two ``AUTH`` exchanges, which carry the challenge-response of
:mod:`torchdist._auth` (each side proves it holds the secret without sending it)::

    AUTH client_nonce (32 bytes)   ->  OK server_nonce (32) | server_proof (32)
    AUTH client_proof (32 bytes)   ->  OK  | UNAUTHENTICATED message, then closed

A client that finds the server's proof wrong sends nothing more. Any other request
before the proof is answered ``UNAUTHENTICATED`` with a message and closed, and so
is an ``AUTH`` sent to a server without a secret: a client without the secret
connects, and learns at its first request that it may not use the store.

Requests and replies
--------------------
=============  ==================================================  ==================================
op             body                                                reply
=============  ==================================================  ==================================
SET            string key, value                                   none (one-way)
APPEND         string key, value                                   none (one-way)
QUEUE_PUSH     string key, value                                   none (one-way)
MULTI_SET      list: key, value, key, value, ...                   none (one-way)
GET            key                                                 OK value; *waits* for the key
WAIT           key list                                            OK; *waits* for every key
MULTI_GET      key list                                            OK value list; *waits* for all
QUEUE_POP      u8 block, key                                       OK value | EMPTY; *waits* if block
ADD            i64 amount, key                                     OK i64 total | ERROR message
COMPARE_SET    u32 nk, u32 ne, key (nk), expected (ne), desired    OK value (new or current)
CHECK          key list                                            OK u8 (all present)
DELETE_KEY     key                                                 OK u8 (existed)
NUM_KEYS       (empty)                                             OK i64
LIST_KEYS      (empty)                                             OK key list
QUEUE_LEN      key                                                 OK i64
CANCEL         (empty)                                             CANCELLED
HELLO, AUTH    see Handshake; never after it                       see Handshake
=============  ==================================================  ==================================

(A *value list* is encoded like a key list.) Writes that cannot fail get no reply,
as in PyTorch: ``set`` costs one ``send`` and no round trip. The connection is
ordered, so a client's next request that has a reply is answered only after its
earlier writes were applied. A reply that would exceed :data:`MAX_FRAME` (a value
grown by ``append``) is sent as ``ERROR`` with a message instead; the client raises
it as ``ValueError``, like ``add`` on a value that is not an integer.

Waiting, and cancelling a wait
------------------------------
A client awaits at most one reply at a time (one-way writes may precede the request
that awaits it); a second request while a wait is open breaks the protocol. The
server never blocks: a request
marked *waits* whose keys are missing registers a *waiter* on the connection and
answers later, when a write makes it satisfiable. Per connection::

    IDLE    --request answerable now-->          reply        --> IDLE
    IDLE    --waiting request, keys missing-->   (no reply)   --> WAITING
    WAITING --a write completes it-->            reply        --> IDLE
    WAITING --CANCEL-->                          CANCELLED    --> IDLE
    IDLE    --CANCEL-->                          CANCELLED    --> IDLE
    WAITING --any other request-->               protocol error: disconnect

The client enforces its own timeout. When it expires it sends ``CANCEL`` and reads
replies until ``CANCELLED``. The key may arrive just as the client gives up: the
server then sent the real reply *before* it read the ``CANCEL``, and answers the
``CANCEL`` from IDLE. The client thus sees the late reply, then ``CANCELLED``, and
returns the late reply rather than raising (a ``queue_pop`` must not drop the value
the server already popped). Either way exactly one ``CANCELLED`` ends the exchange,
so the stream stays in step and the client stays usable after a timeout.
"""

from __future__ import annotations

import enum
import struct
from typing import Sequence

__all__ = ["MAGIC", "VERSION", "MAX_FRAME", "Op", "Status"]

MAGIC = int.from_bytes(b"TDST", "little")  # "torchdist store"
VERSION = 1
#: Largest ``length`` field accepted, in either direction.
MAX_FRAME = 64 * 1024 * 1024


class Op(enum.IntEnum):
    """The first byte of a request frame."""

    HELLO = 1
    SET = 2
    GET = 3
    ADD = 4
    COMPARE_SET = 5
    WAIT = 6
    CHECK = 7
    DELETE_KEY = 8
    NUM_KEYS = 9
    APPEND = 10
    MULTI_GET = 11
    MULTI_SET = 12
    LIST_KEYS = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    CANCEL = 17
    AUTH = 18


class Status(enum.IntEnum):
    """The first byte of a reply frame."""

    OK = 0
    CANCELLED = 1
    EMPTY = 2
    ERROR = 3
    UNAUTHENTICATED = 4  # then the server closes the connection


# Precompiled structs: the hot path packs and unpacks with these only.
HEADER = struct.Struct("<IB")  # length, code
U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
HEADER_U32 = struct.Struct("<IBI")  # length, code, first string's length
HEADER_I64 = struct.Struct("<IBq")  # length, code, an int (ADD, replies carrying an int)
HEADER_U8 = struct.Struct("<IBB")  # length, code, a flag (QUEUE_POP, CHECK/DELETE replies)
HELLO_BODY = struct.Struct("<IIQ")  # magic, version, nonce
HELLO_FRAME_LEN = 1 + HELLO_BODY.size  # the first frame of every connection
HANDSHAKE_MAX = 1024  # the longest frame either side accepts during the handshake


def too_large(length: int) -> ValueError:
    """The error for a message the peer would refuse; raised before anything is sent."""
    return ValueError(
        f"a store message of {length} bytes exceeds the {MAX_FRAME >> 20} MiB limit; "
        "keep large data out of the store (send it with a collective instead)"
    )


def frame(code: int, body: bytes = b"") -> bytes:
    """One complete frame."""
    if len(body) >= MAX_FRAME:
        raise too_large(len(body) + 1)
    return HEADER.pack(len(body) + 1, code) + body


def key_value(code: int, key: bytes, value: bytes) -> bytes:
    """The frame of SET, APPEND and QUEUE_PUSH: ``string key, value``."""
    length = 5 + len(key) + len(value)
    if length > MAX_FRAME:
        raise too_large(length)
    return HEADER_U32.pack(length, code, len(key)) + key + value


def pack_strings(items: Sequence[bytes]) -> bytes:
    """``u32 count | (u32 n | n bytes)*``: a key list, or MULTI_GET's values."""
    parts = [U32.pack(len(items))]
    for item in items:
        parts.append(U32.pack(len(item)))
        parts.append(item)
    return b"".join(parts)


def unpack_strings(buf: bytes | bytearray | memoryview, pos: int, end: int) -> list[bytes]:
    """Inverse of :func:`pack_strings`; raises ValueError on a malformed list."""
    (count,) = U32.unpack_from(buf, pos)
    pos += 4
    if count > (end - pos) // 4:
        raise ValueError(f"a list announces {count} strings in {end - pos} bytes")
    items = []
    for _ in range(count):
        (n,) = U32.unpack_from(buf, pos)
        pos += 4
        if pos + n > end:
            raise ValueError("a string runs past the end of its frame")
        items.append(bytes(buf[pos : pos + n]))
        pos += n
    if pos != end:
        raise ValueError(f"{end - pos} stray bytes after a list")
    return items
