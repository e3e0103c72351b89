"""Authenticate an RPC connection with the job secret before anything is unpickled.

RPC executes code sent by peers (pickles name functions to run), so a connection
must prove it belongs to the job before its first frame is read. The job secret
is the launcher's (``TORCHDIST_SECRET``, see :mod:`torchdist._auth`, whose
primitives this module carries over the RPC sockets). The worker that accepted the
connection plays the server: in a static world the lower id of the pair, in a
dynamic one the member that a joining worker dialed::

    initiator (client: dialed)                     acceptor (server)
      HELLO(magic, version, has_secret) ─────────────►
      ◄───────────── HELLO(magic, version, has_secret)   both must agree on has_secret
      client_nonce ──────────────────────────────────►
      ◄───────────────────── server_nonce, server_proof   client checks, else disconnects
      client_proof ──────────────────────────────────►   server checks
      ◄──────────────────────────────────── OK / FAIL

The secret never crosses the wire. Without a secret only the HELLO is exchanged,
and the agent listens on the one address it was given (never a wildcard):
unauthenticated RPC runs code from anyone who can reach that address.
"""

from __future__ import annotations

import socket
import struct

from .._auth import NONCE_BYTES, PROOF_BYTES, SECRET_ENV, AuthenticationError, ClientHandshake, ServerHandshake
from ..errors import DistNetworkError

__all__ = ["SECRET_ENV", "authenticate", "recv_exact"]

_HELLO = struct.Struct("<8sHB")
_MAGIC = b"TDRPC\x00\x00\x01"
_VERSION = 1


def recv_exact(sock: socket.socket, n: int, during: str = "during the RPC handshake") -> bytes:
    """Exactly ``n`` bytes from the blocking ``sock``; ConnectionResetError (naming what
    was going on, ``during``) if the peer closes it first."""
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(f"the peer closed the connection {during}")
        data += chunk
    return bytes(data)


def authenticate(sock: socket.socket, initiator: bool, peer_name: str, secret: bytes | None,
                 timeout: float) -> None:
    """Run the handshake on a connected socket; raise DistNetworkError if the peer fails it.

    ``initiator``: this worker dialed the connection (and plays the client).
    """
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        sock.sendall(_HELLO.pack(_MAGIC, _VERSION, secret is not None))
        magic, version, has_secret = _HELLO.unpack(recv_exact(sock, _HELLO.size))
        if magic != _MAGIC or version != _VERSION:
            raise DistNetworkError(f"RPC handshake with {peer_name} failed: not a torchdist RPC peer "
                                   f"(magic={magic!r}, version={version})")
        if bool(has_secret) != (secret is not None):
            mine = "has a" if secret is not None else "has no"
            raise AuthenticationError(
                f"RPC handshake with {peer_name} failed: this worker {mine} job secret and the peer does "
                f"not agree. Set {SECRET_ENV} to the same value on every worker (torchdist-run does this).")
        if secret is None:
            return
        if initiator:
            client = ClientHandshake(secret)
            sock.sendall(client.hello())
            sock.sendall(client.answer(recv_exact(sock, NONCE_BYTES + PROOF_BYTES), peer=peer_name))
            if recv_exact(sock, 1) != b"\x01":
                raise AuthenticationError(f"RPC handshake: {peer_name} refused this worker's proof of the "
                                          f"job secret. Set the same {SECRET_ENV} on every worker.")
        else:
            server = ServerHandshake(secret)
            sock.sendall(server.challenge(recv_exact(sock, NONCE_BYTES)))
            ok = server.verify(recv_exact(sock, PROOF_BYTES))
            sock.sendall(b"\x01" if ok else b"\x00")
            if not ok:
                raise AuthenticationError(
                    f"RPC handshake: {peer_name} does not hold the job secret; the connection was refused "
                    f"before reading any message. Set the same {SECRET_ENV} on every worker.")
    except OSError as exc:
        raise DistNetworkError(f"RPC handshake with {peer_name} failed: {exc}") from exc
    finally:
        sock.settimeout(previous)
