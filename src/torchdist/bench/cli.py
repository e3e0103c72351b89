"""Command line of ``torchdist-bench`` (and ``python -m torchdist.bench``).

Example, the nccl-tests experience for CPU::

    torchdist-bench all_reduce -b 8 -e 64M -f 8 --nproc 2 --backend shm --compare gloo \\
        --json out.json --plot out.png

``ops`` is a comma-separated list of all_reduce, broadcast, reduce, all_gather,
reduce_scatter, alltoall, or ``all``. Sizes go from ``-b`` to ``-e``, multiplied
by ``-f`` each time (suffixes K, M, G are powers of 1024). The ranks are
processes on this host started through ``torchdist.testing.run_ranks``; with
``--backend mpi`` they are the processes of the MPI job that runs the command, as
with nccl-tests (``mpiexec -n 2 torchdist-bench all_reduce --backend mpi``; with
``--compare``, the ranks must share one host), and rank 0 prints.
Exit status: 0 if every checked result was right, 1 if any was wrong (``#wrong``
> 0), 2 for a bad command line; a run that fails or times out raises.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import torch

from ..testing import free_port, run_ranks
from . import report
from .worker import OPS, REDOPS, Job, run_rank

__all__ = ["main", "parse_size"]

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"8"`` -> 8, ``"64K"`` -> 65536, ``"64M"`` -> 67108864 (also ``KB``/``KiB``)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    suffix = value[-1:] if value[-1:] in "KMG" else ""
    number = value[:-1] if suffix else value
    try:
        size = int(float(number) * _SUFFIX[suffix])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 16M)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return size


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchdist-bench", description=__doc__.replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="?", default="all_reduce", help=f"comma-separated, or 'all': {', '.join(OPS)}")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=0, help="iterations per round (0: by size)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-r", "--rounds", type=int, default=2, help="alternations of the implementations")
    p.add_argument("-d", "--datatype", default="float32", help="a torch dtype: float32, float16, bfloat16, "
                   "float64, int8, uint8, int32, int64, ...")
    p.add_argument("-o", "--op", default="sum", choices=list(REDOPS))
    p.add_argument("--root", type=int, default=0, help="root rank of broadcast and reduce (0..nproc-1)")
    p.add_argument("-c", "--check", type=int, default=1, help="verify results (#wrong); 0 to skip")
    p.add_argument("--nproc", type=int, default=None, help="ranks (processes) on this host (default 2; "
                   "with --backend mpi, the MPI job's)")
    p.add_argument("--backend", default="auto", help="torchdist backend: auto, shm, tcp, mpi (run under mpiexec)")
    p.add_argument("--compare", default=None, help="also run torch.distributed with this backend (gloo)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--symmetric", action="store_true",
                   help="torchdist's buffers in symmetric memory (torchdist.symmetric_memory; backend shm)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the ranks are killed")
    p.add_argument("--json", default=None, help="write the rows to this file")
    p.add_argument("--plot", default=None, help="plot bus bandwidth and latency vs size (needs matplotlib)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    ops = OPS if args.ops == "all" else tuple(dict.fromkeys(op.strip() for op in args.ops.split(",") if op.strip()))
    if args.stepfactor < 2:
        parser.error(f"-f must be at least 2, got {args.stepfactor}")
    if args.minbytes > args.maxbytes:
        parser.error(f"-b ({args.minbytes}) is larger than -e ({args.maxbytes})")
    mpi_world = _mpi_world() if args.backend == "mpi" else None
    if mpi_world is not None:
        if args.nproc not in (None, mpi_world.Get_size()):
            parser.error(f"--nproc {args.nproc} but the MPI job has {mpi_world.Get_size()} processes; leave it out")
        args.nproc = mpi_world.Get_size()
    elif args.nproc is None:
        args.nproc = 2
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    if not 0 <= args.root < args.nproc:
        parser.error(f"--root must be a rank, 0..{args.nproc - 1}, got {args.root}")
    if not isinstance(getattr(torch, args.datatype, None), torch.dtype):
        parser.error(f"-d: not a torch dtype: {args.datatype!r}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - found out now, not after the run
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'torchdist[bench]' (or matplotlib)")
    sizes, size = [], args.minbytes
    while size <= args.maxbytes:
        sizes.append(size)
        size *= args.stepfactor
    try:
        job = Job(ops=ops, sizes=tuple(sizes), backend=args.backend, compare=args.compare, dtype=args.datatype,
                  redop=args.op, root=args.root, iters=args.iters, warmup=args.warmup_iters, rounds=args.rounds,
                  threads=args.threads, symmetric=args.symmetric, check=bool(args.check), port=free_port(),
                  compare_port=free_port() if args.compare else 0, timeout_s=args.timeout)
    except ValueError as exc:
        parser.error(str(exc))
    # SIGTERM (a scheduler, timeout(1)) ends the run as Ctrl-C does: the ranks are reaped
    # and their scratch folder removed, which the default action skips.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if mpi_world is None:
        results = run_ranks(run_rank, args.nproc, args=(job,), timeout=job.timeout_s)
    else:  # this process is one rank; rank 0 (which picked the ports) reports for all
        job = mpi_world.bcast(job, root=0)
        results = mpi_world.gather(run_rank(mpi_world.Get_rank(), args.nproc, job), root=0)
        if mpi_world.Get_rank() != 0:
            return mpi_world.bcast(None, root=0)
    status = _report(args, job, results)
    if mpi_world is not None:
        mpi_world.bcast(status, root=0)
    return status


def _mpi_world():
    """MPI's COMM_WORLD (``--backend mpi``: this process is one rank of the MPI job)."""
    try:
        from mpi4py import MPI
    except ImportError:
        sys.exit("torchdist-bench --backend mpi needs mpi4py and an MPI library (pip install mpi4py mpich), "
                 "and runs under mpiexec: mpiexec -n 2 torchdist-bench all_reduce --backend mpi")
    return MPI.COMM_WORLD


def _report(args: argparse.Namespace, job: Job, results: list) -> int:
    """Print (and write) the rows of every rank's ``results``; the exit status."""
    rows = report.rows_from(results, job, args.nproc)
    report.print_table(rows, job, args.nproc)
    if args.json:
        report.write_json(rows, job, args.nproc, args.json)
    if args.plot:
        report.plot(rows, job, args.nproc, args.plot)
    sys.stdout.flush()
    return 1 if any(r.wrong for r in rows if r.wrong is not None) else 0
