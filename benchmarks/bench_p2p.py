"""Point-to-point ping-pong: torchdist's backends against torch.distributed "gloo", in one run.

Two ranks bounce a tensor with blocking ``send``/``recv`` (rank 0 sends then
receives, rank 1 the reverse) and report the one-way time: half a round trip,
the median over ``--rounds`` alternating runs of ``--iters`` round trips each
(gloo, then each torchdist backend, then again), so machine noise hits all alike.

Usage::

    python benchmarks/bench_p2p.py [--backends tcp,shm] [--sizes 8,65536] [--iters 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import statistics
import time


def _rank(rank: int, port: int, module: str, backend: str, sizes: list[int], iters: int, queue) -> None:
    import torch
    torch.set_num_threads(1)
    dist = importlib.import_module(module)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    one_way = {}
    for nbytes in sizes:
        t = torch.zeros(max(nbytes // 4, 1))
        for n in (max(iters // 10, 1), iters):  # warm-up, then timed
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
            one_way[nbytes] = (time.perf_counter() - start) / n / 2
    if rank == 0:
        queue.put(one_way)
    dist.barrier()
    dist.destroy_process_group()


def _run(module: str, backend: str, sizes: list[int], iters: int) -> dict[int, float]:
    from torchdist.testing import free_port
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, module, backend, sizes, iters, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="tcp,shm", help="torchdist backends, comma-separated")
    parser.add_argument("--sizes", default="8,65536", help="bytes, comma-separated")
    parser.add_argument("--iters", type=int, default=2000, help="round trips per run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per implementation")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    impls = [("torch.distributed", "gloo")] + [("torchdist", b) for b in args.backends.split(",")]
    times: dict[tuple[str, str], list[dict[int, float]]] = {impl: [] for impl in impls}
    for _ in range(args.rounds):
        for impl in impls:
            times[impl].append(_run(*impl, sizes, args.iters))
    print(f"{'size (B)':>10}  " + "  ".join(f"{m.split('.')[0] + '/' + b:>22}" for m, b in impls))
    for nbytes in sizes:
        medians = {impl: statistics.median(run[nbytes] for run in times[impl]) for impl in impls}
        gloo = medians[impls[0]]
        cells = [f"{medians[impl] * 1e6:>9.1f} us ({medians[impl] / gloo:4.2f}x)" for impl in impls]
        print(f"{nbytes:>10}  " + "  ".join(f"{c:>22}" for c in cells))
    print("one-way time (half a send/recv round trip); ratio: time / gloo's time (below 1: faster)")


if __name__ == "__main__":
    main()
