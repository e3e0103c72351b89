"""The exceptions torchdist raises, with PyTorch's names and base classes.

::

    RuntimeError
     └── DistError               anything that went wrong in distributed code
          ├── DistBackendError   a collective or point-to-point op failed: a peer
          │                      died, disagreed about the op, or the group broke
          ├── DistNetworkError   a socket failed: refused, reset, unreachable host.
          │                      OS errors become this at the transport boundary,
          │                      with the OSError kept as ``__cause__``
          └── DistStoreError     a store operation failed, most often a key that
               │                 did not appear before the timeout
               └── QueueEmptyError   ``queue_pop(block=False)`` on an empty queue

Timeouts of stores raise :class:`DistStoreError` (as PyTorch does); timeouts of
collectives raise :class:`DistBackendError`. Bad arguments from the caller raise
``ValueError`` or ``TypeError`` before anything is sent.

Every message names the operation, the rank and the peers involved, and says what
to do about it.
"""

from __future__ import annotations

__all__ = [
    "DistError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "QueueEmptyError",
]


class DistError(RuntimeError):
    """Base of every error raised by torchdist's distributed machinery."""


class DistBackendError(DistError):
    """A communication backend failed: dead peer, mismatched op, broken group, timeout."""


class DistNetworkError(DistError):
    """A network operation failed (connect, send, receive); the OSError is the cause."""


class DistStoreError(DistError):
    """A store operation failed, typically a wait for keys that timed out."""


class QueueEmptyError(DistStoreError):
    """A non-blocking ``queue_pop`` found the queue empty."""
