"""What each rank of ``torchdist-bench`` runs: init, then time every op x size x implementation.

Sizes follow nccl-tests: ``size`` is the bytes of the tensor each rank passes to
all_reduce / broadcast / reduce, the *output* of all_gather, the *input* of
reduce_scatter, and the per-rank buffer of all_to_all. Every iteration is timed
on its own; the parent takes, per iteration, the slowest rank's time, and
reports the median over iterations (the VM is shared and noisy; a median of
per-iteration maxima is what the reference scripts in /work/shared/bench use).

With ``compare``, each rank also joins a torch.distributed gloo group, and the
two implementations alternate per size and per round (torchdist, gloo, gloo,
torchdist, ...), so both see the same machine conditions. The baseline comes
from ``torchdist_baseline``, an adapter shipped beside the package and loaded
only when asked for: torchdist itself never imports torch.distributed.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Job", "run_rank", "OPS", "BUS_FACTOR"]

logger = logging.getLogger(__name__)

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "alltoall")
#: nccl-tests' bus bandwidth factors: busbw = algbw * factor(world).
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
}


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything a rank needs; equal on all ranks."""

    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    backend: str
    compare: str | None
    dtype: str = "float32"
    redop: str = "sum"
    root: int = 0
    iters: int = 0          # 0: chosen per size (see iterations())
    warmup: int = 5
    rounds: int = 2
    threads: int = 1
    symmetric: bool = False  # torchdist's buffers in symmetric memory
    check: bool = True
    port: int = 0
    compare_port: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPS]
        if unknown:
            raise ValueError(f"unknown ops {unknown}; known: {list(OPS)}")
        if self.rounds < 1 or self.warmup < 0 or self.iters < 0:
            raise ValueError(f"rounds ({self.rounds}) must be >= 1, warmup ({self.warmup}) and iters "
                             f"({self.iters}) >= 0")

    def iterations(self, nbytes: int) -> int:
        """Per round: fixed with ``-n``, else enough to move ~128 MiB (10 to 400)."""
        if self.iters:
            return self.iters
        return max(10, min(400, (128 << 20) // max(nbytes, 1)))


class _Case:
    """One op at one size on one implementation: ``run()`` times, ``check()`` verifies."""

    def __init__(self, dist, op: str, nbytes: int, world: int, rank: int, job: Job,
                 pools: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.dist, self.op, self.world, self.rank = dist, op, world, rank
        self.dtype = getattr(torch, job.dtype)
        self.redop = getattr(dist.ReduceOp, job.redop.upper())
        self.redop_name = job.redop.lower()
        self.root = job.root % world
        # 2.13's names where the module has them (the old ones warn on every call there)
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        esize = torch.empty((), dtype=self.dtype).element_size()
        count = max(nbytes // esize, 1)
        if op in ("all_gather", "reduce_scatter", "alltoall"):
            count = max(count // world, 1) * world
        self.count = count
        small = count // world if op in ("all_gather", "reduce_scatter") else count
        big = count
        # Timing runs on zeros: sums stay finite however many iterations run.
        inp_count, out_count = small if op == "all_gather" else big, small if op == "reduce_scatter" else big
        if pools is None:
            self.inp = torch.zeros(inp_count, dtype=self.dtype)
            self.out = torch.zeros(out_count, dtype=self.dtype)
        else:  # views at offset 0 of the two symmetric pools: the same place on every rank
            self.inp = pools[0].view(self.dtype)[:inp_count].zero_()
            self.out = pools[1].view(self.dtype)[:out_count].zero_()

    def run(self) -> None:
        d, op = self.dist, self.op
        if op == "all_reduce":
            d.all_reduce(self.inp, op=self.redop)
        elif op == "broadcast":
            d.broadcast(self.inp, src=self.root)
        elif op == "reduce":
            d.reduce(self.inp, dst=self.root, op=self.redop)
        elif op == "all_gather":
            self._all_gather(self.out, self.inp)
        elif op == "reduce_scatter":
            self._reduce_scatter(self.out, self.inp, op=self.redop)
        else:
            d.all_to_all_single(self.out, self.inp)

    def check(self) -> int:
        """Run once on known data; the number of wrong elements on this rank."""
        r, n, op = self.rank, self.world, self.op
        value = float(r + 1)
        self.inp.fill_(value)
        ranks = torch.arange(1, n + 1, dtype=torch.float64)
        self.run()
        if op == "all_reduce" or (op == "reduce" and r == self.root):
            expected, got = _reduced(self.redop_name, ranks), self.inp
        elif op == "reduce":
            return 0
        elif op == "broadcast":
            expected, got = float(self.root + 1), self.inp
        elif op == "reduce_scatter":
            expected, got = _reduced(self.redop_name, ranks), self.out
        elif op == "all_gather":
            got = self.out
            expected = torch.arange(1, n + 1, dtype=self.dtype).repeat_interleave(self.count // n)
        else:  # alltoall: block j of the output comes from rank j
            got = self.out
            expected = torch.arange(1, n + 1, dtype=self.dtype).repeat_interleave(self.count // n)
        wrong = int((got != torch.as_tensor(expected, dtype=self.dtype)).sum())
        self.inp.zero_()
        self.out.zero_()
        return wrong


def _reduced(redop: str, ranks: torch.Tensor) -> float:
    if "sum" in redop:
        return float(ranks.sum())
    if "prod" in redop:
        return float(ranks.prod())
    if "min" in redop:
        return float(ranks.min())
    return float(ranks.max())


def _implementations(job: Job, rank: int, world: int) -> dict:
    import torchdist

    torchdist.init_process_group(job.backend, init_method=f"tcp://127.0.0.1:{job.port}", rank=rank,
                                 world_size=world)
    impls = {"torchdist": torchdist}
    if job.compare:
        # The baseline adapter sits outside the package (see the module docstring).
        baseline = importlib.import_module("torchdist_baseline")
        impls[job.compare] = baseline.join_reference_group(job.compare, job.compare_port, rank, world)
    return impls


def run_rank(rank: int, world: int, job: Job) -> dict:
    """Time everything; returns {"times": {(op, size, impl): [seconds per iteration]}, "wrong": {...}}."""
    torch.set_num_threads(job.threads)
    impls = _implementations(job, rank, world)
    names = list(impls)
    times: dict[tuple, list[float]] = {}
    wrong: dict[tuple, int] = {}
    clock = time.perf_counter
    pools = None
    if job.symmetric:  # symmetric memory lives as long as the group: one pair of pools for all sizes
        largest = (max(job.sizes) // 16 + world + 1) * 16  # room for _Case's rounding up, any dtype
        pools = tuple(impls["torchdist"].symmetric_memory.empty(largest, dtype=torch.uint8) for _ in range(2))
    for op in job.ops:
        for nbytes in job.sizes:
            cases = {name: _Case(impls[name], op, nbytes, world, rank, job, pools if name == "torchdist" else None)
                     for name in names}
            iters = job.iterations(nbytes)
            for round_ in range(job.rounds):
                order = names if round_ % 2 == 0 else names[::-1]
                for name in order:
                    case, dist = cases[name], impls[name]
                    for _ in range(job.warmup):
                        case.run()
                    dist.barrier()
                    samples = times.setdefault((op, nbytes, name), [])
                    for _ in range(iters):
                        start = clock()
                        case.run()
                        samples.append(clock() - start)
            for name in names:
                wrong[(op, nbytes, name)] = cases[name].check() if job.check else 0
            del cases
    for name in reversed(names):
        impls[name].destroy_process_group()
    return {"times": times, "wrong": wrong}
