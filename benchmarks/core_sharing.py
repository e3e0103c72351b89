"""What two ranks on one core cost a small all-reduce: CPU time per op, alone and sharing.

With more ranks than cores (world 4 on the 2-core VM) a small collective is
CPU-bound: its wall time is the ranks' CPU time per op times the ranks per core.
This script measures that CPU time (``time.thread_time``) and the wall time of
back-to-back 8-byte all-reduces on the shm backend, one torch thread per rank,
with the ranks spread by the scheduler or pinned (``--pin N``: rank r on core
r % N), and, as a baseline, a bare ping-pong of two processes on one core over
a shared counter (two context switches per round trip, nothing else).

Usage:
    python benchmarks/core_sharing.py [--world-size 2] [--pin 1] [--ops 3000]
    python benchmarks/core_sharing.py --ping-pong
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import time


def _rank(rank: int, world_size: int, port: int, pin: int, ops: int, queue) -> None:
    import torch
    import torchdist as dist

    torch.set_num_threads(1)
    if pin:
        os.sched_setaffinity(0, {rank % pin})
    dist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    tensor = torch.ones(2)
    for _ in range(ops // 10):
        dist.all_reduce(tensor)
    dist.barrier()
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(tensor)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    queue.put((rank, wall / ops * 1e6, cpu / ops * 1e6))
    dist.destroy_process_group()


def all_reduce_costs(world_size: int, pin: int, ops: int) -> list[tuple[int, float, float]]:
    """(rank, wall us per op, CPU us per op) of every rank."""
    from torchdist.testing import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_rank, args=(r, world_size, port, pin, ops, queue)) for r in range(world_size)]
    for process in ranks:
        process.start()
    results = sorted(queue.get(timeout=300) for _ in ranks)
    for process in ranks:
        process.join()
    return results


def _bounce(me: int, shared: mmap.mmap, rounds: int, queue) -> None:
    os.sched_setaffinity(0, {0})
    counters = memoryview(shared).cast("q")
    start = time.perf_counter()
    for i in range(1, rounds + 1):
        if me == 0:
            counters[0] = i
            while counters[1] != i:
                os.sched_yield()
        else:
            while counters[0] != i:
                os.sched_yield()
            counters[1] = i
    queue.put((time.perf_counter() - start) / rounds * 1e6)


def ping_pong(rounds: int) -> float:
    """Microseconds per round trip of two processes on core 0 handing a counter back and forth."""
    ctx = mp.get_context("fork")  # the children share the anonymous mapping
    queue, shared = ctx.Queue(), mmap.mmap(-1, mmap.PAGESIZE)
    pair = [ctx.Process(target=_bounce, args=(me, shared, rounds, queue)) for me in (0, 1)]
    for process in pair:
        process.start()
    times = [queue.get(timeout=300) for _ in pair]
    for process in pair:
        process.join()
    return max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--pin", type=int, default=0, help="pin rank r to core r %% PIN (0: the scheduler places)")
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--ping-pong", action="store_true", help="the bare two-process baseline instead")
    args = parser.parse_args()
    if args.ping_pong:
        print(f"ping-pong on one core: {ping_pong(20 * args.ops):.2f} us per round trip (two switches)")
        return
    placement = f"pinned to {args.pin} core(s)" if args.pin else "placed by the scheduler"
    print(f"8-byte all_reduce, shm, world {args.world_size}, {placement}:")
    for rank, wall, cpu in all_reduce_costs(args.world_size, args.pin, args.ops):
        print(f"  rank {rank}: {wall:6.1f} us per op, {cpu:5.1f} us of CPU")


if __name__ == "__main__":
    main()
