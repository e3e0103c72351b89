"""The shared-memory transport passes the transport conformance suite, and its segments
never outlive the processes that use them.

The conformance tests are tests/transport's, run here against a ``world`` fixture
that builds shared-memory transports (one thread per rank, in this process).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pathlib
import threading
import time

import pytest
import torch

from torchdist._store.hash_store import HashStore
from torchdist._transport.shm import ShmTransport
from torchdist._transport.shm_segment import PREFIX, clean_stale_segments, shm_dir, supported

pytestmark = pytest.mark.skipif(supported() is not None, reason=str(supported()))

_CONFORMANCE = pathlib.Path(__file__).parents[1] / "transport" / "test_transport_conformance.py"
_spec = importlib.util.spec_from_file_location("_shm_conformance", _CONFORMANCE)
_conformance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conformance)
for _name in dir(_conformance):
    if _name.startswith("test_"):
        globals()[_name] = getattr(_conformance, _name)


def shm_world(size: int, label: str = "shm") -> list[ShmTransport]:
    store = HashStore()
    transports: list = [None] * size

    def connect(rank: int) -> None:
        transports[rank] = ShmTransport.connect(store, rank, size, 10.0, list(range(size)), label)
    threads = [threading.Thread(target=connect, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(transports), "a rank failed to map the board"
    return transports


@pytest.fixture
def world():
    made: list[list[ShmTransport]] = []

    def make(size: int) -> list[ShmTransport]:
        transports = shm_world(size)
        made.append(transports)
        return transports
    yield make
    for transports in made:
        for t in transports:
            t.close()


def _ours() -> set[str]:
    return {n for n in os.listdir(shm_dir()) if n.startswith(PREFIX)}


def test_segments_are_unlinked_once_every_rank_mapped_them() -> None:
    before = _ours()
    transports = shm_world(3)
    try:
        assert _ours() <= before  # nothing of ours is left with a name
    finally:
        for t in transports:
            t.close()


def test_stale_segments_of_dead_jobs_are_removed_and_live_ones_kept(tmp_path) -> None:
    dead = os.path.join(shm_dir(), f"{PREFIX}deadbeef-0")
    live = os.path.join(shm_dir(), f"{PREFIX}cafecafe-0")
    young = os.path.join(shm_dir(), f"{PREFIX}0badf00d-0")
    for path in (dead, live, young):
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
    old = time.time() - 60
    os.utime(dead, (old, old))
    os.utime(live, (old, old))
    holder = os.open(live, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a rank of a running job holds its segment's lock
    try:
        clean_stale_segments()
        assert not os.path.exists(dead)
        assert os.path.exists(live) and os.path.exists(young)
    finally:
        os.close(holder)
        for path in (dead, live, young):
            if os.path.exists(path):
                os.unlink(path)


def test_receive_posted_while_an_unexpected_message_streams_in() -> None:
    """Rank 1's 1 MiB message (tag 7) starts arriving while rank 0 waits for rank 2; the
    receive for it is posted mid-stream and must still get it."""
    from torchdist._algorithms.comm import byte_view
    from torchdist._transport.framing import MsgKind, OpFingerprint

    none = OpFingerprint()
    ts = shm_world(3)
    try:
        big = torch.arange(1 << 18, dtype=torch.float32)
        errors: list = []

        def sender() -> None:
            try:
                ts[1].wait([ts[1].isend(0, MsgKind.P2P, 0, none, byte_view(big), 7)], time.monotonic() + 10)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        thread = threading.Thread(target=sender, daemon=True)
        thread.start()
        small = torch.zeros(1)
        from_two = ts[0].irecv(2, MsgKind.P2P, 0, none, byte_view(small), 1)
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # drives the rings: rank 1's message starts streaming in
            ts[0].progress(0.01)
        got = torch.zeros(1 << 18)
        from_one = ts[0].irecv(1, MsgKind.P2P, 0, none, byte_view(got), 7)
        ts[0].wait([from_one], time.monotonic() + 10)
        assert torch.equal(got, big)
        ts[2].wait([ts[2].isend(0, MsgKind.P2P, 0, none, byte_view(torch.ones(1)), 1)], time.monotonic() + 10)
        ts[0].wait([from_two], time.monotonic() + 10)
        thread.join(10)
        assert not errors, errors
    finally:
        for t in ts:
            t.close()


def test_a_step_published_before_a_break_still_completes() -> None:
    """Rank 1 publishes step g, finishes it and breaks; rank 0, looking only now, still
    completes step g (rank 1's data for it stands) and gets the break at its next step."""
    from torchdist._transport.framing import OpFingerprint, OpKind
    from torchdist._transport.shm_board import STEP
    from torchdist.errors import DistBackendError

    fingerprint = OpFingerprint.of(OpKind.ALLREDUCE, torch.float32, 4, -1, 0)
    ts = shm_world(2)
    try:
        mine, theirs = ts[0].steps, ts[1].steps
        mine.begin(0, fingerprint)
        theirs.begin(0, fingerprint)
        ts[0].board.me[STEP] = mine.step + 1  # rank 0 publishes step g (as sync() would first)...
        theirs.sync(time.monotonic() + 5)  # ...rank 1 sees it, completes g...
        ts[1].fail(DistBackendError("rank 1 broke after its step"))  # ...and breaks
        mine.sync(time.monotonic() + 5)  # rank 0 only now looks at rank 1's counter
        mine.begin(1, fingerprint)
        with pytest.raises(DistBackendError, match="broke after its step"):
            mine.sync(time.monotonic() + 5)
    finally:
        for t in ts:
            t.close()


def _setup_with_a_published_peer(timeout: float, names: list[int], label: str):
    """Rank 0 connects (in a thread) to a group of 2 whose rank 1 only creates and publishes
    its segment, as a rank does first; returns (rank 0's outcome, its thread, rank 1's
    segment, the start time). What rank 1 does next is the caller's."""
    from torchdist._transport.shm import CHUNK_BYTES, RING_BYTES
    from torchdist._transport.shm_board import Layout
    from torchdist._transport.shm_segment import Segment

    store = HashStore()
    outcome: dict = {}

    def rank0() -> None:
        try:
            outcome["transport"] = ShmTransport.connect(store, 0, 2, timeout, names, label)
        except Exception as exc:  # noqa: BLE001 - inspected by the caller
            outcome["error"] = exc
    thread = threading.Thread(target=rank0, daemon=True)
    start = time.monotonic()
    thread.start()
    store.wait(["shm/segment/0"])
    segment = Segment.create(Layout(2, RING_BYTES, CHUNK_BYTES).total, 1, "setup")
    store.set("shm/segment/1", segment.path)
    return outcome, thread, segment, start


def test_a_rank_that_dies_during_setup_is_named_at_once_and_its_segment_removed():
    from torchdist.errors import DistNetworkError

    outcome, thread, segment, start = _setup_with_a_published_peer(30.0, [0, 1], "setup")
    # Rank 1 dies (as under SIGKILL: lock gone, name left) before it has mapped rank 0's
    # segment and arrived.
    segment.drop_lock()
    thread.join(30)
    assert isinstance(outcome.get("error"), DistNetworkError), outcome
    assert "ranks [1] exited while shared memory was being set up" in str(outcome["error"])
    assert time.monotonic() - start < 5
    assert not os.path.exists(segment.path)
    segment.buf.close()


def test_a_rank_that_stalls_during_setup_is_named_at_the_timeout():
    """Alive but not arriving: the error comes at the timeout asked for, names the group,
    this rank and the missing one as the user knows them (global ranks 5 and 7 here)."""
    from torchdist.errors import DistStoreError

    outcome, thread, segment, start = _setup_with_a_published_peer(1.2, [5, 7], "group 'g'")
    try:  # rank 1 stays alive (holds its lock) and never arrives
        thread.join(30)
        took = time.monotonic() - start
        error = outcome.get("error")
        assert isinstance(error, DistStoreError), outcome
        assert ("group 'g': rank 5 timed out after 1.2s waiting for ranks [7] to map the group's shared memory"
                in str(error))
        assert 1.1 < took < 4
    finally:
        segment.close()


def test_a_rank_that_dies_during_a_symmetric_allocation_is_named_at_once(world):
    from torchdist._transport.shm_segment import Segment
    from torchdist.errors import DistNetworkError

    transports = world(2)
    heap = transports[0].heap
    outcome: dict = {}

    def rank0() -> None:
        try:
            outcome["tensor"] = heap.allocate(4096)
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc
    thread = threading.Thread(target=rank0, daemon=True)
    start = time.monotonic()
    thread.start()
    # Rank 1 creates and publishes its part of allocation #0, then dies before it arrives.
    segment = Segment.create(4096, 1, "symm")
    heap.store.set("symm/0/1", f"4096 {segment.path}")
    segment.drop_lock()
    thread.join(30)
    assert isinstance(outcome.get("error"), DistNetworkError), outcome
    assert "ranks [1] exited while shared memory was being set up" in str(outcome["error"])
    assert time.monotonic() - start < 5 and not os.path.exists(segment.path)
    segment.buf.close()
