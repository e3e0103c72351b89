"""Run an algorithm on every rank of an in-process loopback world (one thread per rank)."""

from __future__ import annotations

import threading
from typing import Callable

from torchdist._algorithms.comm import Comm
from torchdist._transport.framing import OpFingerprint, OpKind
from torchdist._transport.loopback import LoopbackFabric

FP = OpFingerprint.of(OpKind.ALLREDUCE)


def run_world(size: int, fn: Callable[[Comm, int], object], fabric: LoopbackFabric | None = None,
              piece: int = 64, timeout: float = 30) -> list:
    """``fn(comm, rank)`` on ``size`` threads; returns results, re-raises the first error.

    ``piece`` makes the loopback deliver data in small steps, so reductions that
    consume data as it arrives are exercised piece by piece.
    """
    fabric = fabric or LoopbackFabric(size, piece=piece)
    results: list = [None] * size
    errors: list[BaseException] = []

    def go(rank: int) -> None:
        try:
            results[rank] = fn(Comm(fabric.transports[rank], 0, FP, None), rank)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            for transport in fabric.transports:
                transport.fail(exc)  # wake the others instead of leaving them waiting
    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"deadlock at world {size}"
    if errors:
        raise errors[0]
    return results
