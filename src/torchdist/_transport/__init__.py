"""Layer 4: transports move byte buffers between the ranks of a group.

``base.Transport`` is the interface the algorithms use; ``tcp`` implements it over
sockets (bootstrapped by ``mesh`` through the store), ``loopback`` in one process
for tests. ``framing`` defines the message header, ``matching`` the rules that
pair arriving messages with posted receives.
"""

from .base import EMPTY, PeerTimeout, Transfer, Transport
from .framing import Header, MsgKind, OpFingerprint, OpKind

__all__ = ["Transport", "Transfer", "PeerTimeout", "EMPTY", "Header", "MsgKind", "OpKind", "OpFingerprint"]
