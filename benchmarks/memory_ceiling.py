"""The machine's memory-copy ceiling, and what it allows a shared-memory all-reduce.

A shared-memory collective on a CPU is a sequence of memory copies and reductions,
so the machine's aggregate copy bandwidth bounds it. This script measures that
bandwidth with 1, 2 and ``--world-size`` processes copying at once (``copy_``
of a ``--mib`` buffer, one torch thread each), then prints the fastest an
all-reduce of that size can run at the measured rate for the traffic each path
of the shm backend moves per rank and byte of tensor (docs/design/shm.md):

- ordinary tensors, p >= 3 (the reduce-scatter pipeline): ``5 - 1/p`` passes;
- ordinary tensors, p = 2 (the fold pipeline): 5 passes;
- symmetric tensors: ``1 + 1/p`` reads and ``1/p`` writes for the reduction plus
  ``2 (p - 1) / p`` for the copies.

Usage:
    python benchmarks/memory_ceiling.py [--world-size 4] [--mib 64] [--reps 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time


def _copy_rate(queue, numel: int, reps: int) -> None:
    """Seconds per copy of ``numel`` float32, after three warm-up copies."""
    import torch
    torch.set_num_threads(1)
    source, target = torch.ones(numel), torch.empty(numel)
    for _ in range(3):
        target.copy_(source)
    start = time.perf_counter()
    for _ in range(reps):
        target.copy_(source)
    queue.put((time.perf_counter() - start) / reps)


def aggregate_bandwidth(processes: int, nbytes: int, reps: int) -> float:
    """Bytes read plus written per second by ``processes`` copying at once."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_copy_rate, args=(queue, nbytes // 4, reps)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    seconds = [queue.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join()
    return sum(2 * nbytes / s for s in seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    nbytes, p = args.mib << 20, args.world_size
    counts = sorted({1, 2, p})
    rates = {n: aggregate_bandwidth(n, nbytes, args.reps) for n in counts}
    for n in counts:
        print(f"{n} process(es) copying {args.mib} MiB: {rates[n] / 2**30:.1f} GiB/s read + written in all")
    passes = {
        "ordinary tensors": 5.0 if p == 2 else 5 - 1 / p,
        "symmetric tensors": 1 + 2 / p + 2 * (p - 1) / p,
    }
    for path, per_byte in passes.items():
        floor = p * per_byte * nbytes / rates[p]
        print(f"all_reduce of {args.mib} MiB at world {p}, {path}: {per_byte:.2f} passes per rank and byte, "
              f"at least {floor * 1e3:.1f} ms at the {p}-process rate")


if __name__ == "__main__":
    main()
