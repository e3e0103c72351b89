"""The job secret: challenge-response primitives, and the TCPStore that requires them."""

from __future__ import annotations

from datetime import timedelta

import pytest

from torchdist import TCPStore
from torchdist._auth import (
    NONCE_BYTES,
    AuthenticationError,
    ClientHandshake,
    ServerHandshake,
    new_secret,
    resolve_secret,
)

pytestmark = pytest.mark.timeout(30)


def test_handshake_succeeds_with_the_same_secret():
    client, server = ClientHandshake(b"s3cret"), ServerHandshake(b"s3cret")
    proof = client.answer(server.challenge(client.hello()))
    assert server.verify(proof)


def test_client_refuses_a_server_without_the_secret():
    client, impostor = ClientHandshake(b"s3cret"), ServerHandshake(b"other")
    with pytest.raises(AuthenticationError, match="TORCHDIST_SECRET"):
        client.answer(impostor.challenge(client.hello()))


def test_server_refuses_wrong_proofs_replays_and_reflections():
    secret = b"s3cret"
    server = ServerHandshake(secret)
    client = ClientHandshake(b"wrong")
    challenge = server.challenge(client.hello())
    # A client with the wrong secret cannot answer; a forged answer of the right length fails.
    assert not server.verify(b"\0" * 32)
    # Reflection: the server's own proof is not a valid client proof.
    assert not server.verify(challenge[NONCE_BYTES:])
    # Replay: a proof recorded on one connection does not open another (fresh server nonce).
    honest = ClientHandshake(secret)
    first = ServerHandshake(secret)
    proof = honest.answer(first.challenge(honest.hello()))
    second = ServerHandshake(secret)
    second.challenge(honest.hello())
    assert first.verify(proof) and not second.verify(proof)


def test_secrets_and_their_sources():
    assert len(new_secret()) == 64 and new_secret() != new_secret()
    assert resolve_secret("abc") == b"abc"
    assert resolve_secret(None, {"TORCHDIST_SECRET": "xyz"}) == b"xyz"
    assert resolve_secret(None, {"TORCHDIST_SECRET": ""}) is None
    assert resolve_secret(None, {}) is None
    with pytest.raises(TypeError):
        resolve_secret(42)


def _store(port=0, master=True, secret=None):
    return TCPStore("127.0.0.1", port, None, master, timedelta(seconds=5), wait_for_workers=False, secret=secret)


def test_tcpstore_with_the_secret_works_and_clones_keep_it(monkeypatch):
    monkeypatch.delenv("TORCHDIST_SECRET", raising=False)
    master = _store(secret="job")
    client = _store(master.port, False, secret=b"job")
    try:
        client.set("k", b"v")
        assert master.get("k") == b"v"
        clone = client.clone()
        assert clone.add("n", 2) == 2
        clone.close()
    finally:
        client.close(), master.close()


def test_tcpstore_reads_the_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHDIST_SECRET", "from-env")
    master = _store()
    try:
        assert _store(master.port, False).add("c", 1) == 1
        with pytest.raises(AuthenticationError):
            _store(master.port, False, secret="other")
    finally:
        master.close()


def _use(make_store):
    """Connect and run one request: a refusal may come at the handshake or at the first request."""
    store = make_store()
    try:
        return store.add("probe", 1)
    finally:
        store.close()


def test_connection_without_the_secret_is_refused(monkeypatch):
    monkeypatch.delenv("TORCHDIST_SECRET", raising=False)
    master = _store(secret="job")
    try:
        with pytest.raises(AuthenticationError, match="TORCHDIST_SECRET"):
            _use(lambda: _store(master.port, False))
        with pytest.raises(AuthenticationError):
            _use(lambda: _store(master.port, False, secret="wrong"))
        assert master.num_keys() == 0, "nothing from the refused clients reached the table"
        assert _use(lambda: _store(master.port, False, secret="job")) == 1
    finally:
        master.close()


def test_client_with_a_secret_refuses_an_unauthenticated_server(monkeypatch):
    monkeypatch.delenv("TORCHDIST_SECRET", raising=False)
    master = _store()
    try:
        with pytest.raises(AuthenticationError):
            _use(lambda: _store(master.port, False, secret="job"))
        assert _use(lambda: _store(master.port, False)) == 1, "without secrets nothing changes"
    finally:
        master.close()


def test_refusal_is_immediate_not_retried_until_the_timeout(monkeypatch):
    import time

    monkeypatch.delenv("TORCHDIST_SECRET", raising=False)
    master = _store(secret="job")
    try:
        start = time.monotonic()
        with pytest.raises(AuthenticationError):
            _use(lambda: _store(master.port, False, secret="wrong"))
        assert time.monotonic() - start < 2, "a wrong secret is not a transient error"
    finally:
        master.close()
