"""Turn the ranks' samples into nccl-tests rows; print them, write JSON, plot.

A *row* is one (op, size, implementation): its time is the median over
iterations of the slowest rank's time for that iteration; ``algbw`` is bytes /
time, ``busbw`` applies nccl-tests' factor (see ``worker.BUS_FACTOR``) so that
numbers compare across collectives and world sizes. GB/s = 1e9 B/s.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import TextIO

from .worker import BUS_FACTOR, element_count

__all__ = ["Row", "rows_from", "print_table", "write_json", "plot"]


@dataclass(frozen=True)
class Row:
    op: str
    impl: str
    size: int
    count: int
    dtype: str
    redop: str
    root: int
    time_us: float | None  # None: the implementation does not support the op (``note`` says why)
    algbw: float | None
    busbw: float | None
    wrong: int | None      # None: results not checked (-c 0)
    world: int
    backend: str
    note: str = ""


def rows_from(results: list[dict], job, world: int) -> list[Row]:
    import torch

    esize = torch.empty((), dtype=getattr(torch, job.dtype)).element_size()
    rows = []
    for key in [*results[0]["times"], *results[0]["unsupported"]]:
        op, size, impl = key
        count = element_count(op, size, esize, world)
        nbytes = count * esize
        common = dict(op=op, impl=impl, size=nbytes, count=count, dtype=job.dtype,
                      redop=job.redop if op in ("all_reduce", "reduce", "reduce_scatter") else "none",
                      root=job.root if op in ("broadcast", "reduce") else -1, world=world,
                      backend=job.backend if impl == "torchdist" else impl)
        if key in results[0]["unsupported"]:
            rows.append(Row(**common, time_us=None, algbw=None, busbw=None, wrong=None,
                            note=results[0]["unsupported"][key]))
            continue
        per_rank = [r["times"][key] for r in results]
        seconds = statistics.median(max(samples) for samples in zip(*per_rank))
        algbw = nbytes / seconds / 1e9
        rows.append(Row(**common, time_us=seconds * 1e6, algbw=algbw, busbw=algbw * BUS_FACTOR[op](world),
                        wrong=sum(r["wrong"][key] for r in results) if job.check else None))
    return rows


def print_table(rows: list[Row], job, world: int, out: TextIO = sys.stdout) -> None:
    """nccl-tests' columns per collective; with a comparison, the baseline's and the ratio."""
    compare = job.compare
    print(f"# torchdist-bench: world size {world}, backend {job.backend!r}"
          + (f", compared with torch.distributed {compare!r} (interleaved)" if compare else ""), file=out)
    print("# time: median over iterations of the slowest rank; ratio = baseline time / torchdist time",
          file=out)
    for op in job.ops:
        mine = [r for r in rows if r.op == op and r.impl == "torchdist"]
        if not mine:
            continue
        theirs = {r.size: r for r in rows if r.op == op and r.impl == compare}
        head = (f"{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} {'time':>10} {'algbw':>8} "
                f"{'busbw':>8} {'#wrong':>7}")
        units = (f"{'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>5} {'(us)':>10} {'(GB/s)':>8} "
                 f"{'(GB/s)':>8} {'':>7}")
        if compare:
            head += f" {compare + ' time':>12} {'busbw':>8} {'#wrong':>7} {'ratio':>7}"
            units += f" {'(us)':>12} {'(GB/s)':>8} {'':>7} {'':>7}"
        print(f"#\n# {op}", file=out)
        print("# " + head, file=out)
        print("# " + units, file=out)
        for r in mine:
            line = (f"  {r.size:>12} {r.count:>12} {r.dtype:>8} {r.redop:>6} {r.root:>5} {r.time_us:>10.1f} "
                    f"{r.algbw:>8.3f} {r.busbw:>8.3f} {_wrong(r):>7}")
            other = theirs.get(r.size)
            if other is not None and other.time_us is None:
                line += f" {'n/a':>12} {'n/a':>8} {'n/a':>7} {'n/a':>7}"
            elif other is not None:
                line += (f" {other.time_us:>12.1f} {other.busbw:>8.3f} {_wrong(other):>7} "
                         f"{other.time_us / r.time_us:>6.2f}x")
            print(line, file=out)
        for note in dict.fromkeys(r.note for r in rows if r.op == op and r.note):
            print(f"# n/a: {compare} refused {op} with {job.dtype}: {note}", file=out)
    timed = [r for r in rows if r.time_us is not None]
    busbw = [r.busbw for r in timed if r.impl == "torchdist"]
    if busbw:
        print(f"# Avg bus bandwidth    : {statistics.mean(busbw):.3f} GB/s (torchdist)", file=out)
    if not job.check:
        print("# Out of bounds values : N/A (not checked: -c 0)", file=out)
        return
    bad = sum(r.wrong for r in timed)
    print(f"# Out of bounds values : {bad} {'OK' if bad == 0 else 'FAILED'}", file=out)


def _wrong(row: Row) -> str:
    return "N/A" if row.wrong is None else str(row.wrong)


def write_json(rows: list[Row], job, world: int, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"world_size": world, "backend": job.backend, "compare": job.compare,
                   "command": " ".join(sys.argv), "rows": [asdict(r) for r in rows]}, f, indent=1)


def plot(rows: list[Row], job, world: int, path: str) -> None:
    """Bus bandwidth and latency against size, one line per implementation, one row per op."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'torchdist[bench]' (or matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in job.ops if any(r.op == op for r in rows)]
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.2 * len(ops)), squeeze=False)
    for (bw_ax, lat_ax), op in zip(axes, ops):
        for impl in dict.fromkeys(r.impl for r in rows):
            series = sorted((r for r in rows if r.op == op and r.impl == impl and r.time_us is not None),
                            key=lambda r: r.size)
            label = f"torchdist ({job.backend})" if impl == "torchdist" else f"torch.distributed ({impl})"
            sizes = [r.size for r in series]
            bw_ax.plot(sizes, [r.busbw for r in series], marker="o", label=label)
            lat_ax.plot(sizes, [r.time_us for r in series], marker="o", label=label)
        for ax, what in ((bw_ax, "bus bandwidth (GB/s)"), (lat_ax, "time (us)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(what)
            ax.set_title(f"{op}, world size {world}")
            ax.grid(True, which="both", alpha=0.3)
        lat_ax.set_yscale("log")
        bw_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
