"""Challenge-response authentication with a shared job secret (never sent on the wire).

Every process of a job that may talk to the job's stores (the launcher's agents and
their workers; later the RPC agents) holds the same *secret*: random bytes the
launcher makes per job, or the value a user sets in ``TORCHDIST_SECRET`` on every
node of a multi-node job. A connection proves it holds the secret without revealing
it, and the server proves the same back (mutual authentication)::

    client                                         server
      | -- client_nonce (32 random bytes) ------------> |
      | <----------- server_nonce, server_proof ------- |  server_proof = HMAC(secret, "server" | cn | sn)
      |  check server_proof (constant time)             |
      | -- client_proof ------------------------------> |  client_proof = HMAC(secret, "client" | cn | sn)
      |                                                 |  check client_proof (constant time)
      | <----------- OK, or ERROR and disconnect ------ |

Why this is enough: the proofs are HMAC-SHA256 keyed by the secret over both
nonces, so an eavesdropper learns nothing that opens another connection (fresh
nonces every time: no replay); the direction label differs between the two proofs,
so a server proof cannot be reflected back as a client proof; both sides compare
with :func:`hmac.compare_digest`, so timing reveals nothing. What it does not do:
encrypt or integrity-protect the traffic after the handshake (use a private network
or a tunnel against an active man in the middle).

This module holds only the primitives; the TCPStore client and server carry the
three messages in their own framing (see :mod:`torchdist._store.wire`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Mapping

from .errors import DistNetworkError

__all__ = [
    "SECRET_ENV",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "AuthenticationError",
    "ClientHandshake",
    "ServerHandshake",
    "new_secret",
    "resolve_secret",
]

#: The environment variable that holds the job secret, in the launcher and its workers.
SECRET_ENV = "TORCHDIST_SECRET"
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
_SERVER_LABEL = b"torchdist-auth/v1/server\x00"
_CLIENT_LABEL = b"torchdist-auth/v1/client\x00"


class AuthenticationError(DistNetworkError):
    """A peer failed the challenge-response handshake: it does not hold the job secret."""


def new_secret() -> str:
    """A fresh random job secret (256 bits, hex, so it fits in an environment variable)."""
    return secrets.token_hex(32)


def resolve_secret(secret: str | bytes | None = None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret as bytes: ``secret`` if given, else ``$TORCHDIST_SECRET``; ``None`` when neither is set.

    An empty string means "no secret", so ``TORCHDIST_SECRET=`` disables authentication.
    """
    if secret is None:
        secret = (os.environ if environ is None else environ).get(SECRET_ENV)
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"a job secret must be str or bytes, got {type(secret).__name__}")
    return bytes(secret) or None


def _proof(secret: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, label + client_nonce + server_nonce, hashlib.sha256).digest()


def _check_length(what: str, value: bytes, expected: int) -> None:
    if len(value) != expected:
        raise AuthenticationError(f"authentication handshake: {what} has {len(value)} bytes, expected {expected}")


class ClientHandshake:
    """The connecting side: :meth:`hello` first, then :meth:`answer` the server's challenge."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("ClientHandshake needs a non-empty secret")
        self._secret = secret
        self._nonce = secrets.token_bytes(NONCE_BYTES)

    def hello(self) -> bytes:
        """The first message: this side's nonce."""
        return self._nonce

    def answer(self, challenge: bytes, peer: str = "the server") -> bytes:
        """Check the server's proof in ``challenge`` (server nonce + proof); return our proof.

        Raises :class:`AuthenticationError` when the server does not hold the secret:
        a client never sends anything else to a server that failed to prove itself.
        """
        _check_length("the server's challenge", challenge, NONCE_BYTES + PROOF_BYTES)
        server_nonce, server_proof = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
        expected = _proof(self._secret, _SERVER_LABEL, self._nonce, server_nonce)
        if not hmac.compare_digest(expected, server_proof):
            raise AuthenticationError(
                f"{peer} failed to prove that it holds this job's secret: it belongs to another job or "
                f"was started with a different {SECRET_ENV}. Set the same {SECRET_ENV} on every node."
            )
        return _proof(self._secret, _CLIENT_LABEL, self._nonce, server_nonce)


class ServerHandshake:
    """The accepting side: :meth:`challenge` the client's nonce, then :meth:`verify` its proof."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("ServerHandshake needs a non-empty secret")
        self._secret = secret
        self._client_nonce: bytes | None = None
        self._server_nonce = secrets.token_bytes(NONCE_BYTES)

    def challenge(self, client_nonce: bytes) -> bytes:
        """Our nonce and our proof, in answer to the client's nonce."""
        _check_length("the client's nonce", client_nonce, NONCE_BYTES)
        if self._client_nonce is not None:
            raise AuthenticationError("authentication handshake: the client sent its nonce twice")
        self._client_nonce = bytes(client_nonce)
        proof = _proof(self._secret, _SERVER_LABEL, self._client_nonce, self._server_nonce)
        return self._server_nonce + proof

    def verify(self, client_proof: bytes) -> bool:
        """True when the client proved it holds the secret (compared in constant time)."""
        if self._client_nonce is None or len(client_proof) != PROOF_BYTES:
            return False
        expected = _proof(self._secret, _CLIENT_LABEL, self._client_nonce, self._server_nonce)
        return hmac.compare_digest(expected, bytes(client_proof))
