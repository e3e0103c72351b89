"""torchdist "tcp" against torch.distributed "gloo", side by side in one run.

Times all_reduce, all_gather_into_tensor, reduce_scatter_tensor and broadcast
from 8 B to 64 MiB at the given world sizes, for both implementations, and
prints each one's median time, bus bandwidth and the ratio tcp/gloo. The two
implementations alternate (gloo, tcp, gloo, tcp, ...) ``--repeats`` times and
the best median of each is kept, so a noisy neighbour on the machine hurts both
alike. Sizes and bus-bandwidth factors follow nccl-tests: all_reduce 2(n-1)/n,
all_gather / reduce_scatter (n-1)/n of the *total* buffer, broadcast 1.

``--sweep`` instead times all_reduce with each algorithm forced in turn
(``TORCHDIST_ALGO_ALLREDUCE``), which is how the crossovers in
``torchdist._algorithms.select`` were measured.

Usage::

    python benchmarks/bench_collectives.py --world-sizes 2,4 [--ops all_reduce] [--sizes 8,1048576]
    python benchmarks/bench_collectives.py --sweep --world-sizes 2,4
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
import warnings

OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"]
SIZES = [8, 64, 512, 4096, 32768, 262144, 2 << 20, 16 << 20, 64 << 20]
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather_into_tensor": lambda n: (n - 1) / n,
       "reduce_scatter_tensor": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def _iters(nbytes: int) -> int:
    return max(5, min(300, (256 << 20) // max(nbytes, 1)))


def _make(dist, op: str, rank: int, world: int, nbytes: int):
    import torch

    count = max(world, nbytes // 4 // world * world)
    if op == "all_reduce":
        t = torch.full((count,), float(rank + 1))
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        t = torch.full((count,), float(rank))
        return lambda: dist.broadcast(t, src=0)
    if op == "all_gather_into_tensor":
        inp, out = torch.full((count // world,), float(rank)), torch.empty(count)
        return lambda: dist.all_gather_into_tensor(out, inp)
    inp, out = torch.full((count,), float(rank)), torch.empty(count // world)
    return lambda: dist.reduce_scatter_tensor(out, inp)


def _rank(rank: int, world: int, port: int, module: str, backend: str, ops: list[str],
          sizes: list[int], env: dict, queue) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    try:
        times = _time_ops(importlib.import_module(module), backend, rank, world, port, ops, sizes)
    except BaseException as exc:  # report instead of leaving the parent waiting
        queue.put((rank, repr(exc)))
        raise
    queue.put((rank, times))


def _time_ops(dist, backend: str, rank: int, world: int, port: int, ops: list[str], sizes: list[int]) -> dict:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    times = {}
    for op in ops:
        for nbytes in sizes:
            fn = _make(dist, op, rank, world, nbytes)
            n = _iters(nbytes)
            for _ in range(max(2, n // 10)):
                fn()
            dist.barrier()
            samples = []
            for _ in range(n):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            times[op, nbytes] = samples
    dist.barrier()
    dist.destroy_process_group()
    return times


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, module: str, backend: str, ops: list[str], sizes: list[int], env: dict) -> dict:
    """Median over iterations of the slowest rank's time, per (op, size), in seconds."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, module, backend, ops, sizes, env, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        per_rank = dict(queue.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, v in per_rank.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError(f"{module}/{backend} world {world}: ranks failed: {failed}")
    return {key: statistics.median(max(per_rank[r][key][i] for r in per_rank)
                                   for i in range(len(per_rank[0][key]))) for key in per_rank[0]}


def _best(runs: list[dict]) -> dict:
    return {key: min(run[key] for run in runs) for key in runs[0]}


def compare(worlds: list[int], ops: list[str], sizes: list[int], repeats: int) -> dict:
    table = {}
    for world in worlds:
        gloo, tcp = [], []
        for _ in range(repeats):
            gloo.append(run(world, "torch.distributed", "gloo", ops, sizes, {}))
            tcp.append(run(world, "torchdist", "tcp", ops, sizes, {}))
        gloo_best, tcp_best = _best(gloo), _best(tcp)
        print(f"\n## world size {world} (median of slowest rank, best of {repeats} alternating runs)")
        print(f"{'op':24} {'bytes':>10} {'gloo us':>10} {'tcp us':>10} {'gloo GB/s':>10} {'tcp GB/s':>10} "
              f"{'tcp/gloo time':>14}")
        for (op, nbytes), t_tcp in tcp_best.items():
            t_gloo = gloo_best[op, nbytes]
            bus = BUS[op](world) * nbytes / 1e9
            print(f"{op:24} {nbytes:>10} {t_gloo * 1e6:>10.1f} {t_tcp * 1e6:>10.1f} {bus / t_gloo:>10.3f} "
                  f"{bus / t_tcp:>10.3f} {t_tcp / t_gloo:>14.2f}")
            table[f"{world}/{op}/{nbytes}"] = {"gloo_s": t_gloo, "tcp_s": t_tcp, "ratio": t_tcp / t_gloo}
    return table


def sweep(worlds: list[int], sizes: list[int], repeats: int) -> dict:
    table = {}
    algos = ["direct", "recursive_doubling", "ring"]
    for world in worlds:
        runs = {a: [] for a in algos}
        for _ in range(repeats):
            for algo in algos:
                runs[algo].append(run(world, "torchdist", "tcp", ["all_reduce"], sizes,
                                      {"TORCHDIST_ALGO_ALLREDUCE": algo}))
        best = {a: _best(r) for a, r in runs.items()}
        print(f"\n## all_reduce algorithm sweep, world size {world} (median us, best of {repeats})")
        print(f"{'bytes':>10} " + " ".join(f"{a:>20}" for a in algos))
        for key in best[algos[0]]:
            print(f"{key[1]:>10} " + " ".join(f"{best[a][key] * 1e6:>20.1f}" for a in algos))
            table[f"{world}/{key[1]}"] = {a: best[a][key] for a in algos}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sweep", action="store_true", help="time each all_reduce algorithm instead")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    worlds = [int(w) for w in args.world_sizes.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.sweep:
        table = sweep(worlds, sizes, args.repeats)
    else:
        table = compare(worlds, args.ops.split(","), sizes, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
