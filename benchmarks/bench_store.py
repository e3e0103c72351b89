"""Benchmark: torchdist.TCPStore against torch.distributed.TCPStore, in one invocation.

Measures, for each implementation:

- set+get pairs per second and add calls per second, with 1 and 64 concurrent
  clients, every client in its own process (so client-side Python does not share
  a GIL); the server lives in a process of its own;
- the time for 1024 clients (spread over 64 processes) to connect and pass a
  store barrier (``add`` a counter, the last one sets a key, all ``wait``), and
  how many of them failed (connection resets, timeouts): the target is zero.

Notes for reading the numbers: torch's ``set`` is one-way and its ``get`` is two
round trips (wait, then get); torchdist's ``set`` is one-way and its ``get`` one
round trip. ``add`` is one round trip in both. Child processes come from a
forkserver that imported both libraries once. Each throughput figure is the best
of ``--repeat`` runs, alternating which library goes first, because the machine
may be shared; the barrier runs once per library.

Usage::

    python benchmarks/bench_store.py [--duration 2] [--clients 1 64] [--barrier-clients 1024]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from datetime import timedelta

TIMEOUT = timedelta(seconds=120)
HOST = "127.0.0.1"


def _store_class(impl: str):
    if impl == "torch":
        import torch.distributed as dist
    else:
        import torchdist as dist
    return dist.TCPStore


def _serve(impl: str, port_queue, stop) -> None:
    """Host the master store until ``stop`` is set."""
    store = _store_class(impl)(HOST, 0, None, True, TIMEOUT, wait_for_workers=False)
    port_queue.put(store.port)
    stop.wait()
    del store


def _ops_client(impl: str, port: int, rank: int, op: str, duration: float, ready, start, results) -> None:
    """Run ``op`` in a loop for ``duration`` seconds after ``start``; report the count."""
    store = _store_class(impl)(HOST, port, None, False, TIMEOUT)
    key, value = f"key{rank}", b"x" * 32
    store.set(key, value)
    ready.put(rank)
    start.wait()
    count, deadline = 0, time.perf_counter() + duration
    if op == "set+get":
        while time.perf_counter() < deadline:
            for _ in range(50):
                store.set(key, value)
                store.get(key)
            count += 50
    else:
        while time.perf_counter() < deadline:
            for _ in range(50):
                store.add(key + "/n", 1)
            count += 50
    results.put(count)


def _barrier_client(impl: str, port: int, clients: int, world: int, start, results) -> None:
    """``clients`` stores: connect, ``add``, the last arrival releases, everyone ``wait``s.

    Stores are constructed one after the other within a process (processes run in
    parallel): torch's TCPStore constructor is not safe to call from several threads
    at once (concurrent calls connect to garbled addresses and stall ~10 s).
    """
    cls = _store_class(impl)
    errors: list[str] = []
    done_at: list[float] = []

    def barrier(store) -> None:
        try:
            if store.add("barrier", 1) == world:
                store.set("barrier/done", b"1")
            store.wait(["barrier/done"])
            done_at.append(time.time())
        except Exception as exc:  # noqa: BLE001 - counted and reported, not raised
            errors.append(type(exc).__name__)

    start.wait()
    stores = []
    for _ in range(clients):
        try:
            stores.append(cls(HOST, port, None, False, TIMEOUT))
        except Exception as exc:  # noqa: BLE001 - counted and reported, not raised
            errors.append(type(exc).__name__)
    workers = [threading.Thread(target=barrier, args=(store,)) for store in stores]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    results.put((max(done_at) if done_at else float("nan"), errors))


def _reap(procs) -> None:
    for proc in procs:
        proc.join(timeout=30)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _with_server(ctx, impl: str, body):
    port_queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(impl, port_queue, stop), daemon=True)
    server.start()
    try:
        return body(port_queue.get(timeout=120))
    finally:
        stop.set()
        _reap([server])


def measure_ops(ctx, impl: str, clients: int, op: str, duration: float) -> float:
    def body(port: int) -> float:
        ready, start, results = ctx.Queue(), ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(target=_ops_client, args=(impl, port, r, op, duration, ready, start, results))
            for r in range(clients)
        ]
        try:
            for proc in procs:
                proc.start()
            for _ in procs:
                ready.get(timeout=300)
            start.set()
            total = sum(results.get(timeout=300) for _ in procs)
        finally:
            _reap(procs)
        return total / duration

    return _with_server(ctx, impl, body)


def measure_barrier(ctx, impl: str, world: int, processes: int) -> tuple[float, int]:
    def body(port: int) -> tuple[float, int]:
        start, results = ctx.Event(), ctx.Queue()
        per = [world // processes + (1 if i < world % processes else 0) for i in range(processes)]
        procs = [
            ctx.Process(target=_barrier_client, args=(impl, port, n, world, start, results)) for n in per
        ]
        try:
            for proc in procs:
                proc.start()
            time.sleep(1.0)  # let every process reach start.wait()
            t0 = time.time()
            start.set()
            outcomes = [results.get(timeout=600) for _ in procs]
        finally:
            _reap(procs)
        errors = [e for _, errs in outcomes for e in errs]
        return max(t for t, _ in outcomes) - t0, len(errors)

    return _with_server(ctx, impl, body)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per throughput run")
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--barrier-clients", type=int, default=1024)
    parser.add_argument("--barrier-processes", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="throughput runs per measure (best kept)")
    args = parser.parse_args(argv)

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "torchdist"])
    rows = []
    for clients in args.clients:
        for op in ("set+get", "add"):
            best = {"torch": 0.0, "torchdist": 0.0}
            for rep in range(args.repeat):  # alternate who goes first; keep the best of each
                for impl in ("torch", "torchdist") if rep % 2 == 0 else ("torchdist", "torch"):
                    best[impl] = max(best[impl], measure_ops(ctx, impl, clients, op, args.duration))
            ours, theirs = best["torchdist"], best["torch"]
            unit = "pairs/s" if op == "set+get" else "ops/s"
            rows.append((f"{op} {unit}, {clients} client(s)", ours, theirs, ours / theirs, f"best of {args.repeat}"))
    if args.barrier_clients:
        theirs, their_err = measure_barrier(ctx, "torch", args.barrier_clients, args.barrier_processes)
        ours, our_err = measure_barrier(ctx, "torchdist", args.barrier_clients, args.barrier_processes)
        rows.append(
            (
                f"{args.barrier_clients} clients connect + barrier, seconds",
                ours,
                theirs,
                theirs / ours,
                f"failures: torchdist {our_err}, torch {their_err}",
            )
        )

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"# {os.cpu_count()} CPUs, load average after the run: {load}")
    print("| measure | torchdist | torch.distributed | torchdist / torch (>1: torchdist better) | notes |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, ours, theirs, ratio, note in rows:
        fmt = "{:.2f}" if name.endswith("seconds") else "{:,.0f}"
        print(f"| {name} | {fmt.format(ours)} | {fmt.format(theirs)} | {ratio:.2f}x | {note} |")


if __name__ == "__main__":
    main()
