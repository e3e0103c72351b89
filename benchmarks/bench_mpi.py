"""The "mpi" backend against torch.distributed "gloo", torchdist "tcp" and mpi4py itself, in one job.

Every rank of one ``mpiexec`` job joins four groups over the same processes:
torchdist ``"mpi"`` (the default group), a torchdist ``"tcp"`` group, a
torch.distributed ``"gloo"`` group, and plain ``mpi4py`` ``Allreduce`` on the
tensors' memory (MPI's own collective: what the library offers without
torchdist's matching and checks). For each size, ``--rounds`` alternating runs
of ``--iters`` all-reduces each; rank 0 prints the median time per op and the
ratio of gloo's time to each (above 1: faster than gloo).

Usage::

    mpiexec -n 2 python benchmarks/bench_mpi.py [--sizes 8,65536,2097152] [--iters 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as tdist
from mpi4py import MPI

import torchdist as dist


def _timed(step, iters: int) -> float:
    for _ in range(max(iters // 10, 1)):
        step()
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    elapsed = MPI.COMM_WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX)  # the slowest rank's
    return elapsed / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,65536,2097152,16777216", help="bytes per rank, comma-separated")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    tcp = dist.new_group(backend="tcp")
    port = MPI.COMM_WORLD.bcast(_free_port() if rank == 0 else None, root=0)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    contenders = {
        "gloo": lambda t: tdist.all_reduce(t),
        "mpi": lambda t: dist.all_reduce(t),
        "tcp": lambda t: dist.all_reduce(t, group=tcp),
        "mpi4py": lambda t: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, t.numpy()),
    }
    if rank == 0:
        print(f"world {world}, {args.iters} all-reduces of float32 per run, median of {args.rounds} runs (us)")
        print(f"{'bytes':>10} " + " ".join(f"{name:>10}" for name in contenders)
              + " " + " ".join(f"{'gloo/' + name:>12}" for name in contenders if name != "gloo"))
    for nbytes in (int(s) for s in args.sizes.split(",")):
        tensor = torch.ones(max(nbytes // 4, 1))
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, step in contenders.items():
                times[name].append(_timed(lambda: step(tensor), args.iters))
        median = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
        if rank == 0:
            print(f"{nbytes:>10} " + " ".join(f"{median[name]:>10.1f}" for name in contenders)
                  + " " + " ".join(f"{median['gloo'] / median[name]:>12.2f}" for name in contenders if name != "gloo"))
    tdist.destroy_process_group()
    dist.destroy_process_group()


def _free_port() -> int:
    from torchdist.testing import free_port

    return free_port()


if __name__ == "__main__":
    main()
