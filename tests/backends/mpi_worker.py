"""What each rank of an ``mpiexec`` job runs for tests/backends/test_mpi_backend.py.

``python -m tests.backends.mpi_worker MODE DIR`` under ``mpiexec -n N``: every rank
joins the default group with ``init_process_group("mpi")``, runs MODE, and writes its
result as JSON to ``DIR/<rank>.json``; an exception writes ``{"error": traceback}``
instead (the process still exits 0, so the launcher does not stop the others).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from datetime import timedelta

import torch
import torch.nn.functional as F

import torchdist as dist


def battery() -> list[str]:
    """Every collective for several dtypes, small (inline) and large (separate payloads)."""
    from tests.c10d.test_collectives_api import _battery

    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
                  torch.complex64):
        wrong += _battery(rank, world, dtype)
    n = 300_001  # 1.2 MB: ring all-reduce, payloads over the inline size
    big = torch.arange(n, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(big)
    if not torch.equal(big, torch.arange(n, dtype=torch.float64) * (world * (world + 1) // 2)):
        wrong.append("large all_reduce")
    outs = [torch.empty(n // 10, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(outs, torch.full((n // 10,), rank, dtype=torch.int32))
    if any(not torch.all(o == r) for r, o in enumerate(outs)):
        wrong.append("large all_gather")
    for n in (4096, 4097):  # 16384 bytes ride in the frame; 16388 travel as a message of their own
        t = torch.full((n,), float(rank + 1))
        dist.all_reduce(t)
        if not torch.all(t == world * (world + 1) // 2):
            wrong.append(f"all_reduce of {n} floats")
    strided = torch.arange(40.0).reshape(4, 10)[:, ::2] * (rank + 1)
    dist.all_reduce(strided)
    if not torch.equal(strided, torch.arange(40.0).reshape(4, 10)[:, ::2] * (world * (world + 1) // 2)):
        wrong.append("strided all_reduce")
    return wrong


def point_to_point() -> dict:
    """Tags, any-source receives, messages that arrive before their receive, async ops."""
    rank, world = dist.get_rank(), dist.get_world_size()
    got = {}
    if rank == 0:
        big = torch.empty(50_000)  # over the inline size
        time.sleep(0.3)  # the sends below arrive first: read into memory, then taken
        dist.recv(big, src=1, tag=7)
        small = torch.empty(3)
        dist.recv(small, src=1, tag=8)
        got["early"] = [big.sum().item(), small.tolist()]
        sources = []
        for _ in range(world - 1):
            t = torch.empty(1)
            sources.append(dist.recv(t, tag=9))
            got.setdefault("any", []).append(t.item())
        got["sources"] = sorted(sources)
    else:
        if rank == 1:
            dist.send(torch.ones(50_000), dst=0, tag=7)
            dist.send(torch.tensor([1.0, 2.0, 3.0]), dst=0, tag=8)
        dist.send(torch.tensor([float(rank)]), dst=0, tag=9)
    # A receive larger than the message takes it into its leading elements (as gloo),
    # on both sides of the inline size; an empty message.
    if world > 1 and rank < 2:
        peer = 1 - rank
        for n in (3, 4097):
            if rank == 0:
                dist.send(torch.arange(float(n)), dst=peer, tag=n)
            else:
                into = torch.full((n + 10,), -1.0)
                dist.recv(into, src=peer, tag=n)
                got[f"larger recv {n}"] = [into[:n].sum().item(), into[n:].tolist()]
        if rank == 0:
            dist.send(torch.empty(0), dst=peer)
        else:
            dist.recv(torch.empty(0), src=peer)
    # Thousands of outstanding small messages of one tag arrive in the order they were sent.
    if world > 1 and rank < 2:
        if rank == 0:
            works = [dist.isend(torch.tensor([float(i)]), dst=1, tag=3) for i in range(2000)]
        else:
            into = [torch.empty(1) for _ in range(2000)]
            works = [dist.irecv(t, src=0, tag=3) for t in into]
        for work in works:
            work.wait()
        if rank == 1:
            got["in order"] = torch.cat(into).tolist() == [float(i) for i in range(2000)]
    # A ring of isend/irecv (batch_isend_irecv), 20 KB each way.
    right, left = (rank + 1) % world, (rank - 1) % world
    out, into = torch.full((5000,), float(rank)), torch.empty(5000)
    ops = [dist.P2POp(dist.isend, out, right), dist.P2POp(dist.irecv, into, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    got["ring"] = into[0].item()
    # An async all-reduce overlapping local compute.
    t = torch.ones(100_000)
    work = dist.all_reduce(t, async_op=True)
    torch.randn(200, 200) @ torch.randn(200, 200)
    work.wait()
    got["async"] = t[0].item()
    return got


def groups() -> dict:
    """Sub-groups (two disjoint ones at once), a group of another backend, objects."""
    rank, world = dist.get_rank(), dist.get_world_size()
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    tcp = dist.new_group(backend="tcp")  # the job's store, from the MPI rendezvous, serves it
    u = torch.tensor([1])
    dist.all_reduce(u, group=tcp)
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    return {"sub": t.item(), "tcp": u.item(), "objects": objects, "backend": dist.get_backend()}


def ddp() -> bool:
    """DDP over MPI matches one process trained on the whole batch."""
    from tests.ddp._common import LR, TOL, build, full_batches, shard, state, train_reference

    rank, world = dist.get_rank(), dist.get_world_size()
    model = dist.DistributedDataParallel(build("mlp", seed=rank), bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in full_batches("mlp", world, 3):
        opt.zero_grad()
        F.cross_entropy(model(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    want = train_reference("mlp", world, 3)
    got = state(model.module)
    return all(torch.allclose(got[k], want[k], **TOL) for k in want)


def mismatch() -> list[str]:
    """Rank 0 all-reduces float32, the others float64: every rank raises, naming both ops."""
    t = torch.ones(4, dtype=torch.float32 if dist.get_rank() == 0 else torch.float64)
    errors = []
    for _ in range(2):  # the second call raises at once: the group is broken
        try:
            dist.all_reduce(t)
            errors.append("no error")
        except dist.DistBackendError as exc:
            errors.append(str(exc))
    return errors


def two_roots() -> str:
    """Rank 0 broadcasts 400 KB from itself, the others from rank 1: ranks 0 and 1 only
    send, and each finds the other's message contradicting its own send. Rank 1 comes
    late: else, at world 3, ranks 1 and 2 could finish their broadcast before rank 0's
    message reaches them (a root whose sends complete returns; see docs/design)."""
    if dist.get_rank() == 1:
        time.sleep(0.5)
    start = time.monotonic()
    try:
        dist.broadcast(torch.ones(100_000), src=0 if dist.get_rank() == 0 else 1)
        return "no error"
    except dist.DistError as exc:
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"


def stall() -> str:
    """The last rank sleeps past the group's timeout: the others raise at the timeout,
    naming it. Once back, it may finish that op (the others sent their part before they
    timed out) but raises at the next: the group was aborted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(timeout=timedelta(seconds=2))
    if rank == world - 1:
        time.sleep(4)
    start = time.monotonic()
    try:
        for _ in range(2):
            dist.all_reduce(torch.ones(2), group=group)
        return "no error"
    except dist.DistError as exc:
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"


def chain() -> str:
    """World 4, the last rank stalls in a dissemination barrier and rank 0 comes 0.2 s late:
    rank 2 times out waiting on rank 0, which itself waits on the stalled rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(timeout=timedelta(seconds=2))
    dist.barrier(group=group)
    if rank == world - 1:
        time.sleep(5)
    elif rank == 0:
        time.sleep(0.2)
    try:
        dist.barrier(group=group)
        return "no error"
    except dist.DistError as exc:
        return str(exc)


def left() -> str:
    """Rank 1 destroys the group and exits while rank 0 waits for a message from it."""
    if dist.get_rank() == 1:
        dist.destroy_process_group()
        return "left"
    start = time.monotonic()
    try:
        dist.recv(torch.empty(2), src=1)
        return "no error"
    except dist.DistError as exc:
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"


def left_unreceived() -> str:
    """Rank 1 destroys the group without receiving the 4 MB rank 0 sends it."""
    if dist.get_rank() == 1:
        time.sleep(0.5)
        dist.destroy_process_group()
        return "left"
    start = time.monotonic()
    try:
        dist.send(torch.ones(1 << 20), dst=1)
        return "no error"
    except dist.DistError as exc:
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"


def crash() -> str:
    """Rank 1 dies of an exception of its own (the interpreter exits through its exit
    handlers) while rank 0 waits for it in a collective."""
    if dist.get_rank() == 1:
        raise SystemExit("rank 1: a bug in the training script")
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
        return "no error"
    except dist.DistError as exc:
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"


MODES = {f.__name__: f for f in (battery, point_to_point, groups, ddp, mismatch, two_roots, stall, chain, left, left_unreceived, crash)}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("mpi", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    try:
        result = MODES[mode]()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - reported to the test
        result = {"error": traceback.format_exc()}
    (out / f"{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
