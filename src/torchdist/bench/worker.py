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

__all__ = ["Job", "run_rank", "OPS", "REDOPS", "BUS_FACTOR", "element_count"]

logger = logging.getLogger(__name__)

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "alltoall")
#: ``-o`` names -> ReduceOp attribute names.
REDOPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX"}
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
        if unknown or not self.ops:
            raise ValueError(f"unknown ops {unknown}; known: {list(OPS)}" if unknown else "no op given")
        if self.redop not in REDOPS:
            raise ValueError(f"unknown reduce op {self.redop!r}; known: {list(REDOPS)}")
        if self.rounds < 1 or self.warmup < 0 or self.iters < 0:
            raise ValueError(f"rounds ({self.rounds}) must be >= 1, warmup ({self.warmup}) and iters "
                             f"({self.iters}) >= 0")

    def iterations(self, nbytes: int) -> int:
        """Per round: fixed with ``-n``, else enough to move ~128 MiB (10 to 400)."""
        if self.iters:
            return self.iters
        return max(10, min(400, (128 << 20) // max(nbytes, 1)))


def element_count(op: str, nbytes: int, esize: int, world: int) -> int:
    """Elements of the op's (larger) buffer for ``nbytes``: at least one, and for the ops
    that split it across ranks a multiple of the world size."""
    count = max(nbytes // esize, 1)
    if op in ("all_gather", "reduce_scatter", "alltoall"):
        count = max(count // world, 1) * world
    return count


class _Case:
    """One op at one size on one implementation: ``run()`` times, ``check()`` verifies."""

    def __init__(self, dist, op: str, nbytes: int, world: int, rank: int, job: Job,
                 pools: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.dist, self.op, self.world, self.rank = dist, op, world, rank
        self.dtype = getattr(torch, job.dtype)
        self.redop = getattr(dist.ReduceOp, REDOPS[job.redop])
        self.redop_name = job.redop
        self.root = job.root
        # 2.13's names where the module has them (the old ones warn on every call there)
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        count = element_count(op, nbytes, torch.empty((), dtype=self.dtype).element_size(), world)
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
        """Run once on known data; the number of wrong elements on this rank.

        Every rank's input differs by rank *and* position (``_data``), so an element
        in the wrong place counts as wrong, not only a wrong value; the expected
        result is computed here from every rank's input, in the op's dtype."""
        r, n, op = self.rank, self.world, self.op
        size = self.inp.numel()
        inputs = [self._data(j, size) for j in range(n)]
        self.inp.copy_(inputs[r])
        self.run()
        if op == "reduce" and r != self.root:
            wrong = 0  # what a non-root's buffer holds afterwards is unspecified
        else:
            if op in ("all_reduce", "reduce"):
                expected, got = self._fold(inputs), self.inp
            elif op == "broadcast":
                expected, got = inputs[self.root], self.inp
            elif op == "reduce_scatter":
                block = self.out.numel()
                expected, got = self._fold([x[r * block:(r + 1) * block] for x in inputs]), self.out
            elif op == "all_gather":
                expected, got = torch.cat(inputs), self.out
            else:  # alltoall: block j of the output is block r of rank j's input
                block = size // n
                expected, got = torch.cat([x[r * block:(r + 1) * block] for x in inputs]), self.out
            wrong = int((got != expected).sum())
        self.inp.zero_()
        self.out.zero_()
        return wrong

    def _data(self, rank: int, numel: int) -> torch.Tensor:
        """Rank ``rank``'s check input: small integers, exact in every dtype and in any
        order of reduction (products of ones and twos for prod), that depend on the
        position modulo a prime (13 for reductions, whose sums must stay small; 97
        otherwise) and on the rank, so that a block or element in the wrong place shows."""
        period = 13 if self.op in ("all_reduce", "reduce", "reduce_scatter") else 97
        phase = (torch.arange(period) + 31 * rank) % period
        values = (phase == 0).long() + 1 if self.redop_name == "prod" else phase + 1
        return values.to(self.dtype).repeat(-(-numel // period))[:numel]

    def _fold(self, parts: list[torch.Tensor]) -> torch.Tensor:
        combine = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}[self.redop_name]
        result = parts[0].clone()
        for part in parts[1:]:
            result = combine(result, part)
        return result


def _implementations(job: Job, rank: int, world: int) -> dict:
    import torchdist

    if job.backend == "mpi":  # rank and world size come from the MPI job
        torchdist.init_process_group("mpi")
    else:
        torchdist.init_process_group(job.backend, init_method=f"tcp://127.0.0.1:{job.port}", rank=rank,
                                     world_size=world)
    impls = {"torchdist": torchdist}
    if job.compare:
        # The baseline adapter sits outside the package (see the module docstring).
        baseline = importlib.import_module("torchdist_baseline")
        impls[job.compare] = baseline.join_reference_group(job.compare, job.compare_port, rank, world)
    return impls


def run_rank(rank: int, world: int, job: Job) -> dict:
    """Time everything; returns {"times": {(op, size, impl): [seconds per iteration]},
    "wrong": {...}, "unsupported": {(op, size, impl): why}}. Sizes that round to the
    same element count as the one before are skipped (tiny sizes round up)."""
    torch.set_num_threads(job.threads)
    impls = _implementations(job, rank, world)
    names = list(impls)
    times: dict[tuple, list[float]] = {}
    wrong: dict[tuple, int] = {}
    unsupported: dict[tuple, str] = {}
    clock = time.perf_counter
    esize = torch.empty((), dtype=getattr(torch, job.dtype)).element_size()
    pools = None
    if job.symmetric:  # one pair of pools for all sizes: an allocation per case costs a collective
        largest = (max(job.sizes) // 16 + world + 1) * 16  # room for _Case's rounding up, any dtype
        pools = tuple(impls["torchdist"].symmetric_memory.empty(largest, dtype=torch.uint8) for _ in range(2))
    for op in job.ops:
        counts = set()
        for nbytes in job.sizes:
            count = element_count(op, nbytes, esize, world)
            if count in counts:
                continue
            counts.add(count)
            cases = {name: _Case(impls[name], op, nbytes, world, rank, job, pools if name == "torchdist" else None)
                     for name in names}
            for name in names[1:]:  # the baseline may lack the dtype or op: its columns say n/a
                why = _refusal(cases[name])
                if why is not None:
                    unsupported[(op, nbytes, name)] = why
                    del cases[name]
            iters = job.iterations(nbytes)
            for round_ in range(job.rounds):
                order = list(cases) if round_ % 2 == 0 else list(cases)[::-1]
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
            for name, case in cases.items():
                wrong[(op, nbytes, name)] = case.check() if job.check else 0
            del cases
    for name in reversed(names):
        impls[name].destroy_process_group()
    return {"times": times, "wrong": wrong, "unsupported": unsupported}


def _refusal(case: _Case) -> str | None:
    """Run ``case`` once: None if it works, else why not. A dtype or op the library does
    not support raises on every rank before anything is sent (gloo: "Invalid scalar
    type"), so all ranks skip it alike."""
    try:
        case.run()
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None
