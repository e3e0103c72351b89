"""Collectives that read peers' memory directly, over the shared-memory step protocol.

Same entry points and signatures as ``collectives`` (a backend swaps the module),
for transports that offer :class:`~torchdist._transport.shm_steps.Steps` as
``transport.steps``; on any other transport each function falls back to
``collectives``. The protocol (one synchronization per step, two alternating
region sets, fingerprints compared at the first step) is described in
``shm_steps``; here is only what each rank writes and reads. ``c`` is the chunk
(region) size, ``n`` the bytes of one rank's tensor, ``p`` the group size.

- ``allreduce``, small (``n <= SMALL_BYTES``): one step. Every rank copies its
  tensor into its IN region; after the sync every rank folds all p regions in
  rank order into its tensor: the same expression everywhere, so bit-identical
  results, and no second synchronization (the prototype's 4-6 us at world 2).
- ``allreduce``, large, p = 2: every rank copies chunk ``s`` in while combining
  the peer's chunk ``s - 1`` into its own tensor (``_fold_pipeline``).
- ``allreduce``, large, p >= 3: a pipeline over chunks of ``c`` bytes, one step each
  plus one. In step ``s`` a rank copies chunk ``s`` in, reduces *its slice* (1/p) of
  chunk ``s - 1`` from every rank's IN into its OUT, and copies chunk ``s - 2``
  out of everyone's OUT: reduce-scatter and all-gather through memory, each byte
  copied in once and out once (the ring's bytes, without the ring's p - 1 steps),
  and every slice reduced by one rank, so results are bit-identical. A rank's own
  slice is not copied in: nobody else reads it, so the fold takes it from the
  rank's tensor (per rank and byte, 5 - 1/p passes over memory, not 5 + 1/p).
- ``allreduce``, p >= 3, from ``CROSS_MIN_BYTES`` (2 MiB), where the group can read
  its peers' memory (``Board.pids``): the symmetric-memory schedule below on the
  caller's ordinary tensors, whose addresses go with the first step, read in the
  peers' processes with ``process_vm_readv`` (``_cross_allreduce``): 2.75 passes
  per rank and byte at p = 4 instead of 4.75.
- ``reduce``: the same, only the root copies out.
- AVG's division (``finish``) is applied where a piece is finished, while it is in
  cache: to the whole tensor after the small fold, to each chunk after the p = 2
  fold, to the rank's own slice in OUT before the others copy it out.
- ``broadcast``: the root copies chunk ``s`` in while the others copy chunk
  ``s - 1`` out of the root's region.
- ``allgather`` / ``gather``: every rank copies chunk ``s`` of its piece in; the
  others (the root) copy chunk ``s - 1`` of each peer's piece out.
- ``reduce_scatter`` / ``scatter``: the region is cut in p sub-slots of ``c / p``
  bytes, one per destination; rank ``d`` folds (copies) sub-slot ``d`` of every
  rank (of the root).
- Every one of these, *small* (all a rank writes fits ``SMALL_BYTES``): one step,
  over views of the regions cached per size (``Steps.slots``), because at a few
  bytes slicing tensors costs more than moving them: a rank's whole contribution
  goes in with one call (``torch.cat`` for a list), and all-gather into one
  tensor comes out with one ``torch.cat``.
- ``alltoall``: one empty step (fingerprints), then the transport's messages.
- Large copies *out* of the regions into the caller's tensors go through
  ``copy_into`` (``comm.py``: one ``memmove``: 20% faster for a 64 MiB broadcast at world 2);
  copies *into* the regions stay ``Tensor.copy_``, because ``memmove`` there made
  the p = 2 all-reduce 3-10% slower (the peer reads those lines next).
- ``barrier``: one empty step.

*Symmetric tensors* (``_transport/shm_heap``: every rank's twin at the same place,
readable by all) larger than ``SMALL_BYTES`` skip the regions: all-reduce is
sync, every rank reduces *its slice* of all twins into its own tensor, sync,
every rank copies the other slices from their owners' tensors, sync (the last
one so that nobody changes its tensor while a peer still reads it); per rank and
byte that is ``1 + 1/p`` reads for the reduction and ``2 (p-1)/p`` for the
copies, against the pipeline's ``5 - 1/p`` passes. Broadcast: sync, the others
copy the root's tensor, sync. All-gather into a symmetric output: sync, copy
every peer's piece from its twin, sync. Reduce-scatter of a symmetric input:
sync, fold chunk ``r`` of every twin into the output, sync. The (allocation,
offset) code is part of the fingerprint (``aux``), so ranks that disagree about
it raise.
"""

from __future__ import annotations

import errno
import os

import torch

from .._transport import cross_memory
from ..errors import DistBackendError
from . import collectives
from .comm import Comm, chunk_bounds, copy_into, gather_pieces
from .reduction import Combine, Finish, combiner, commutes

__all__ = ["allreduce", "broadcast", "reduce", "allgather", "allgather_into", "reduce_scatter", "alltoall",
           "gather", "scatter", "barrier", "SMALL_BYTES"]

#: Up to this many bytes all-reduce folds every rank's whole tensor after one step;
#: beyond it the pipeline, whose per-rank reduction work is 1/p of it, wins.
SMALL_BYTES = 128 << 10
_IN, _OUT = 0, 2
#: Up to this group size large all-reduces fold whole chunks on every rank (see
#: ``_fold_pipeline``); beyond it, the reduce-scatter pipeline.
_FOLD_ALL_MAX_RANKS = int(os.environ.get("TORCHDIST_SHM_FOLD_ALL_MAX_RANKS", "2"))
_SUM = combiner("SUM", torch.float32)
#: From this many bytes on, all-reduce at p >= 3 reads the peers' tensors where they
#: lie (``process_vm_readv``) when the group can (``Board.pids``), instead of the pipeline.
CROSS_MIN_BYTES = int(os.environ.get("TORCHDIST_SHM_CROSS_MIN", str(2 << 20)))
#: A peer's data is folded in pieces of this many bytes, read into scratch that stays in cache.
_CROSS_PIECE = 256 << 10


def _steps(comm: Comm):
    return getattr(comm.transport, "steps", None)


def _combine_pair(mine: torch.Tensor, peer: torch.Tensor, r: int, combine: Combine) -> None:
    """``mine = x0 op x1`` in place at p = 2, where ``mine`` holds x_r: the same bits on
    both ranks. ``x1 op x0`` is those bits too, except for MIN and MAX of floats
    (``reduction.commutes``), which rank 1 computes in the order of rank 0."""
    if r == 0 or commutes(combine, mine.dtype):
        combine(mine, peer)
        return
    lower = peer.clone()
    combine(lower, mine)
    mine.copy_(lower)


def _fold(out: torch.Tensor, parts: list[torch.Tensor], combine: Combine) -> None:
    """``out = parts[0] op parts[1] op ...`` in rank order (``out`` may not alias a part)."""
    if combine is _SUM and len(parts) > 1:
        torch.add(parts[0], parts[1], out=out)
        rest = parts[2:]
    else:
        out.copy_(parts[0])
        rest = parts[1:]
    for part in rest:
        combine(out, part)


def _small(steps, nbytes: int) -> bool:
    """Whether ``nbytes`` per rank go through the IN regions in one step."""
    return nbytes <= SMALL_BYTES and nbytes <= steps.chunk


def _count(numel: int, per: int) -> int:
    return max(1, -(-numel // per))


def _twins(comm: Comm, start: int, nbytes: int, dtype: torch.dtype) -> tuple[list[torch.Tensor] | None, int]:
    """Every rank's twin of the ``nbytes`` at address ``start`` if they are symmetric
    memory and worth the direct path (more than ``SMALL_BYTES``), and their
    fingerprint code (0: ordinary)."""
    if nbytes <= SMALL_BYTES:  # first: every small collective passes here
        return None, 0
    heap = getattr(comm.transport, "heap", None)
    found = heap.find(start, nbytes) if heap is not None else None
    if found is None:
        return None, 0
    allocation, offset = found
    return [allocation.of(j, offset, nbytes, dtype) for j in range(comm.size)], heap.describe(*found)


def _flat_twins(comm: Comm, flat: torch.Tensor) -> tuple[list[torch.Tensor] | None, int]:
    return _twins(comm, flat.data_ptr(), flat.nbytes, flat.dtype)


def _read_peer(steps, comm: Comm, peer: int, remote: int, local: int, nbytes: int) -> None:
    """Copy ``nbytes`` at ``remote`` in rank ``peer``'s process to ``local`` in ours."""
    try:
        cross_memory.read(steps.board.pids[peer], remote, local, nbytes)
    except OSError as exc:
        board = steps.board
        # A peer whose memory went away (ESRCH: its process is exiting, while its
        # segment's lock may still be held for a moment) is lost, and if some rank
        # broke first, that rank's reason is the cause to report.
        if exc.errno == errno.ESRCH:
            raise board.lost(peer) from exc
        board.check_aborts()
        board.check_alive([peer])
        raise DistBackendError(f"{board.label}: rank {board.names[comm.rank]} cannot read rank "
                               f"{board.names[peer]}'s tensor in collective #{comm.seq} "
                               f"{comm.fingerprint.describe()}: {exc}. Set TORCHDIST_SHM_CMA=0 to "
                               "move data through shared memory instead.") from exc


def _reads_peers(steps, size: int, nbytes: int) -> bool:
    """Whether an all-reduce of ``nbytes`` reads the peers' tensors: at p = 2 the fold
    pipeline is as fast (measured 64 MiB 11.7-12.3 ms against 13.5-13.6, 1 MiB
    0.16 ms against 0.20; faster only at 4-16 MiB, by 10-20%)."""
    return size > _FOLD_ALL_MAX_RANKS and nbytes >= CROSS_MIN_BYTES and steps.board.pids is not None


def _cross_allreduce(steps, comm: Comm, flat: torch.Tensor, combine: Combine, finish: Finish | None) -> None:
    """All-reduce reading the peers' tensors in their processes (``cross_memory``).

    Sync; every rank reduces *its slice* (1/p) of every tensor into its own, a
    peer's piece at a time through scratch that stays in cache; sync; every rank
    copies the other slices from their owners' tensors; sync (so that nobody
    changes its tensor while a peer still reads it). The symmetric-memory path's
    schedule, for ordinary tensors: per rank and byte ``(p-1)/p`` read from peers
    and ``2/p`` of its own slice for the reduction, ``2 (p-1)/p`` for the copies,
    2.75 passes at p = 4 against the pipeline's 4.75."""
    if not flat.is_contiguous():  # (flatten() gives contiguous tensors; a view could not be read remotely)
        work = flat.contiguous()
        _cross_allreduce(steps, comm, work, combine, finish)
        flat.copy_(work)
        return
    p, r, esize = comm.size, comm.rank, flat.element_size()
    bounds = chunk_bounds(flat.numel(), p)
    steps.begin(comm.seq, comm.fingerprint, address=flat.data_ptr())
    steps.sync(comm.deadline)  # every rank's address is published, and the fingerprints agree
    addresses = [steps.address_of(j) for j in range(p)]
    lo, hi = bounds[r]
    piece = comm.scratch(max(_CROSS_PIECE // esize, 1), flat.dtype)
    for a in range(lo, hi, piece.numel()):  # my slice: x_r op x_0 op x_1 ..., here only
        b = min(a + piece.numel(), hi)
        mine, theirs = flat[a:b], piece[:b - a]
        for j in range(p):
            if j != r:
                _read_peer(steps, comm, j, addresses[j] + a * esize, theirs.data_ptr(), (b - a) * esize)
                combine(mine, theirs)
        if finish is not None:
            finish(mine)
    steps.sync(comm.deadline)  # every slice is reduced
    for j, (lo, hi) in enumerate(bounds):
        if j != r and hi > lo:
            _read_peer(steps, comm, j, addresses[j] + lo * esize, flat[lo:hi].data_ptr(), (hi - lo) * esize)
    steps.sync(comm.deadline)  # nobody reads my tensor any more


def allreduce(comm: Comm, flat: torch.Tensor, combine: Combine, finish: Finish | None = None) -> None:
    steps = _steps(comm)
    if steps is None:
        return collectives.allreduce(comm, flat, combine, finish)
    twins, code = _flat_twins(comm, flat) if comm.size > 1 else (None, 0)
    if twins is None:
        if _reads_peers(steps, comm.size, flat.nbytes):
            return _cross_allreduce(steps, comm, flat, combine, finish)
        return _reduce(steps, comm, flat, combine, root=None, finish=finish)
    p, r = comm.size, comm.rank
    bounds = chunk_bounds(flat.numel(), p)
    steps.begin(comm.seq, comm.fingerprint, code)
    steps.sync(comm.deadline)  # every rank's input is in place, and the fingerprints agree
    lo, hi = bounds[r]
    if hi > lo:  # my slice: x_r op x_0 op x_1 ... computed here only, copied by the others
        mine = flat[lo:hi]
        for j in range(p):
            if j != r:
                combine(mine, twins[j][lo:hi])
        if finish is not None:
            finish(mine)
    steps.sync(comm.deadline)  # every slice is reduced
    for j, (lo, hi) in enumerate(bounds):
        if j != r and hi > lo:
            copy_into(flat[lo:hi], twins[j][lo:hi])
    steps.sync(comm.deadline)  # nobody reads my tensor any more


def reduce(comm: Comm, flat: torch.Tensor, root: int, combine: Combine) -> None:
    steps = _steps(comm)
    if steps is None:
        return collectives.reduce(comm, flat, root, combine)
    _reduce(steps, comm, flat, combine, root=root)


def _reduce(steps, comm: Comm, flat: torch.Tensor, combine: Combine, root: int | None,
            finish: Finish | None = None) -> None:
    """All-reduce (``root`` None) or reduce to ``root``; see the module docstring."""
    p, r, n = comm.size, comm.rank, flat.numel()
    dtype = flat.dtype
    steps.begin(comm.seq, comm.fingerprint)
    if p == 1:
        steps.sync(comm.deadline)
        if finish is not None:
            finish(flat)
        return
    if _small(steps, n * flat.element_size()):
        slots = steps.slots(dtype, n)
        slots[(steps.step + 1) % 2][r].copy_(flat)
        steps.sync(comm.deadline)
        if root is None or root == r:
            if p == 2:  # see _fold_pipeline
                _combine_pair(flat, slots[steps.step % 2][1 - r], r, combine)
            else:
                _fold(flat, slots[steps.step % 2], combine)
            if finish is not None:
                finish(flat)
        return
    per = steps.chunk // flat.element_size()
    copy_out = root is None or root == r
    if p <= _FOLD_ALL_MAX_RANKS:
        _fold_pipeline(steps, comm, flat, combine, per, copy_out, finish)
        return
    chunks = [(a, min(a + per, n)) for a in range(0, n, per)]
    slices = [chunk_bounds(b - a, p) for a, b in chunks]

    def gather_out(c: int) -> None:  # chunk c's reduced slices, from everyone's OUT
        a, _ = chunks[c]
        for j, (lo, hi) in enumerate(slices[c]):
            if hi > lo:
                copy_into(flat[a + lo:a + hi], steps.theirs(j, _OUT, dtype)[lo:hi])

    for s in range(len(chunks) + 1):
        if copy_out and s >= 2:
            gather_out(s - 2)
        if s >= 1:  # reduce my slice of chunk s - 1 into my OUT; mine is still in my tensor
            lo, hi = slices[s - 1][r]
            if hi > lo:
                a, _ = chunks[s - 1]
                out = steps.mine(_OUT, dtype)[lo:hi]
                _fold(out, [flat[a + lo:a + hi] if j == r else steps.theirs(j, _IN, dtype)[lo:hi]
                            for j in range(p)], combine)
                if finish is not None:
                    finish(out)
        if s < len(chunks):  # copy chunk s in, but for my slice: only I reduce it
            a, b = chunks[s]
            lo, hi = slices[s][r]
            into = steps.mine(_IN, dtype)
            into[:lo].copy_(flat[a:a + lo])
            into[hi:b - a].copy_(flat[a + hi:b])
        steps.sync(comm.deadline)
    if copy_out:
        gather_out(len(chunks) - 1)


def _fold_pipeline(steps, comm: Comm, flat: torch.Tensor, combine: Combine, per: int, fold: bool,
                   finish: Finish | None) -> None:
    """Every rank folds every rank's whole chunk ``s - 1`` while copying chunk ``s`` in.

    Per rank and byte: copy in (read 1, write 1), fold (read p, write 1): 2 + p + 1
    passes over memory, against 5 - 1/p for the reduce-scatter pipeline, and one
    stage less. Better at p = 2 although it moves more bytes (5 vs 4.5: its own
    chunk is read back from cache): measured 15 ms against 18-20 ms at 64 MiB and
    2.7-2.9 ms against 3.4-5.3 ms at 16 MiB; worse beyond, where everyone would
    read everything.
    At p = 2 each rank combines the peer's chunk into its own tensor, whose chunk
    is still in cache from the copy-in (``_combine_pair``)."""
    n, dtype, p, r = flat.numel(), flat.dtype, comm.size, comm.rank
    count = _count(n, per)
    for s in range(count + 1):
        if s >= 1 and fold:
            a, b = (s - 1) * per, min(s * per, n)
            if p == 2:
                _combine_pair(flat[a:b], steps.theirs(1 - r, _IN, dtype)[:b - a], r, combine)
            else:
                _fold(flat[a:b], [steps.theirs(j, _IN, dtype)[:b - a] for j in range(p)], combine)
            if finish is not None:
                finish(flat[a:b])
        if s == count:
            break
        a, b = s * per, min((s + 1) * per, n)
        steps.mine(_IN, dtype)[:b - a].copy_(flat[a:b])
        steps.sync(comm.deadline)


def broadcast(comm: Comm, flat: torch.Tensor, root: int) -> None:
    steps = _steps(comm)
    if steps is None:
        return collectives.broadcast(comm, flat, root)
    r, n, dtype = comm.rank, flat.numel(), flat.dtype
    twins, code = _flat_twins(comm, flat)
    if twins is not None:
        steps.begin(comm.seq, comm.fingerprint, code)
        steps.sync(comm.deadline)  # the root's data is in place
        if r != root:
            copy_into(flat, twins[root])
        steps.sync(comm.deadline)  # the root may change its tensor again
        return
    if _small(steps, n * flat.element_size()):
        slots = steps.slots(dtype, n)
        steps.begin(comm.seq, comm.fingerprint)
        if r == root:
            slots[(steps.step + 1) % 2][r].copy_(flat)
        steps.sync(comm.deadline)
        if r != root:
            flat.copy_(slots[steps.step % 2][root])
        return
    per = steps.chunk // flat.element_size()
    count = _count(n, per)
    steps.begin(comm.seq, comm.fingerprint)
    for s in range(count + 1):
        if s >= 1 and r != root:
            a, b = (s - 1) * per, min(s * per, n)
            copy_into(flat[a:b], steps.theirs(root, _IN, dtype)[:b - a])
        if s == count:
            break
        if r == root:
            a, b = s * per, min((s + 1) * per, n)
            steps.mine(_IN, dtype)[:b - a].copy_(flat[a:b])
        steps.sync(comm.deadline)


def allgather(comm: Comm, pieces: list[torch.Tensor]) -> None:
    steps = _steps(comm)
    if steps is None:
        return collectives.allgather(comm, pieces)
    blocks, code = _block_twins(comm, pieces)
    if blocks is None:
        return _gather(steps, comm, pieces, pieces[comm.rank], None)
    n = pieces[0].numel()
    steps.begin(comm.seq, comm.fingerprint, code)
    steps.sync(comm.deadline)  # every rank's piece is in place
    for j, piece in enumerate(pieces):
        if j != comm.rank:
            copy_into(piece, blocks[j][j * n:(j + 1) * n])
    steps.sync(comm.deadline)  # nobody reads my piece any more


def allgather_into(comm: Comm, output: torch.Tensor, input: torch.Tensor) -> None:
    steps = _steps(comm)
    n = input.numel()
    if steps is None or not _small(steps, n * input.element_size()):
        return allgather(comm, gather_pieces(output, input, comm.size, comm.rank))
    slots = steps.slots(input.dtype, n)
    steps.begin(comm.seq, comm.fingerprint)
    slots[(steps.step + 1) % 2][comm.rank].copy_(input)
    steps.sync(comm.deadline)
    torch.cat(slots[steps.step % 2], out=output)


def _block_twins(comm: Comm, pieces: list[torch.Tensor]) -> tuple[list[torch.Tensor] | None, int]:
    """For one per rank equal ``pieces`` back to back in symmetric memory (an all-gather's
    output, a reduce-scatter's input): every rank's twin of the whole block, and its code."""
    first, n = pieces[0], pieces[0].numel()
    esize = first.element_size()
    if len(pieces) * n * esize <= SMALL_BYTES:  # first: _twins would say no anyway
        return None, 0
    if any(piece.numel() != n or piece.data_ptr() != first.data_ptr() + j * n * esize
           for j, piece in enumerate(pieces)):
        return None, 0
    return _twins(comm, first.data_ptr(), len(pieces) * n * esize, first.dtype)


def gather(comm: Comm, outputs: list[torch.Tensor] | None, input: torch.Tensor, root: int) -> None:
    steps = _steps(comm)
    if steps is None:
        return collectives.gather(comm, outputs, input, root)
    if comm.rank == root:
        copy_into(outputs[root], input)
        _gather(steps, comm, outputs, input, root)
    else:  # every piece has the input's size (the API checked the root's outputs)
        _gather(steps, comm, [input] * comm.size, input, root)


def _gather(steps, comm: Comm, pieces: list[torch.Tensor], mine: torch.Tensor, root: int | None) -> None:
    """All-gather pieces may differ in size (every rank has the same list); a gather's
    have the input's size (the API checks), so every rank sees the same largest."""
    p, r, dtype = comm.size, comm.rank, mine.dtype
    reader = root is None or root == r
    if _small(steps, max(piece.numel() for piece in pieces) * mine.element_size()):
        steps.begin(comm.seq, comm.fingerprint)
        steps.slots(dtype, mine.numel())[(steps.step + 1) % 2][r].copy_(mine)
        steps.sync(comm.deadline)
        if reader:
            parity = steps.step % 2
            for j, piece in enumerate(pieces):
                if j != r:
                    piece.copy_(steps.slots(dtype, piece.numel())[parity][j])
        return
    per = steps.chunk // max(mine.element_size(), 1)
    count = max(_count(piece.numel(), per) for piece in pieces)
    steps.begin(comm.seq, comm.fingerprint)
    for s in range(count + 1):
        if s >= 1 and reader:
            a = (s - 1) * per
            for j in range(p):
                b = min(a + per, pieces[j].numel())
                if j != r and b > a:
                    copy_into(pieces[j][a:b], steps.theirs(j, _IN, dtype)[:b - a])
        if s == count:
            break
        a, b = s * per, min((s + 1) * per, mine.numel())
        if b > a:
            steps.mine(_IN, dtype)[:b - a].copy_(mine[a:b])
        steps.sync(comm.deadline)


def reduce_scatter(comm: Comm, chunks: list[torch.Tensor], combine: Combine, output: torch.Tensor) -> None:
    steps = _steps(comm)
    if steps is None:
        return collectives.reduce_scatter(comm, chunks, combine, output)
    blocks, code = _block_twins(comm, chunks)
    r, n = comm.rank, output.numel()
    start = chunks[0].data_ptr()
    if blocks is None or start <= output.data_ptr() < start + comm.size * n * output.element_size():
        return _scatter(steps, comm, chunks, output, combine, None)  # (an output inside the input: ordinary)
    steps.begin(comm.seq, comm.fingerprint, code)
    steps.sync(comm.deadline)  # every rank's input is in place
    _fold(output, [block[r * n:(r + 1) * n] for block in blocks], combine)
    steps.sync(comm.deadline)  # nobody reads my input any more


def scatter(comm: Comm, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> None:
    steps = _steps(comm)
    if steps is None:
        return collectives.scatter(comm, output, inputs, root)
    _scatter(steps, comm, inputs, output, None, root)


def _scatter(steps, comm: Comm, sources: list[torch.Tensor] | None, output: torch.Tensor,
             combine: Combine | None, root: int | None) -> None:
    """Reduce-scatter (``root`` None: fold sub-slot r of everyone) or scatter (copy the root's)."""
    p, r, dtype = comm.size, comm.rank, output.dtype
    esize = max(output.element_size(), 1)
    n = output.numel()
    writer = root is None or root == r
    # One step if small and every piece has the output's size (for scatter the API checks
    # that the root's do; a reduce-scatter's list is the same on every rank).
    if _small(steps, p * n * esize) and (sources is None or all(t.numel() == n for t in sources)):
        steps.begin(comm.seq, comm.fingerprint)
        if writer:
            torch.cat(sources, out=steps.slots(dtype, p * n)[(steps.step + 1) % 2][r])
        steps.sync(comm.deadline)
        theirs = steps.slots(dtype, n, r * n)[steps.step % 2]
        if root is None:
            _fold(output, theirs, combine)
        else:
            copy_into(output, theirs[root])
        return
    per = max((steps.chunk // p) // 64 * 64 // esize, 1)  # elements per destination per step
    # Every rank knows every destination's size from its own list, except scatter's
    # non-roots; all ranks take the step count from the largest piece they can see,
    # which for scatter is equal (the API checks equal sizes) and for reduce-scatter
    # is the same list on every rank.
    sizes = [t.numel() for t in sources] if sources is not None else [n] * p
    count = max(_count(size, per) for size in sizes)
    steps.begin(comm.seq, comm.fingerprint)
    for s in range(count + 1):
        if s >= 1:
            a, b = (s - 1) * per, min(s * per, n)
            if b > a:
                lo, hi = r * per, r * per + (b - a)
                if root is None:
                    _fold(output[a:b], [steps.theirs(j, _IN, dtype)[lo:hi] for j in range(p)], combine)
                else:
                    copy_into(output[a:b], steps.theirs(root, _IN, dtype)[lo:hi])
        if s == count:
            break
        if writer:
            region = steps.mine(_IN, dtype)
            a = s * per
            for d in range(p):
                b = min(a + per, sizes[d])
                if b > a:
                    region[d * per:d * per + b - a].copy_(sources[d][a:b])
        steps.sync(comm.deadline)


def alltoall(comm: Comm, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    steps = _steps(comm)
    if steps is not None:
        steps.begin(comm.seq, comm.fingerprint)  # fingerprints first: a mismatch raises here
        steps.sync(comm.deadline)
    collectives.alltoall(comm, outputs, inputs)


def barrier(comm: Comm) -> None:
    steps = _steps(comm)
    if steps is None:
        return collectives.barrier(comm)
    steps.begin(comm.seq, comm.fingerprint)
    steps.sync(comm.deadline)
