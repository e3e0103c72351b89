"""All-reduce of sparse COO tensors, as gloo offers it: SUM only, result coalesced, in place.

No backend reduces sparse data: every rank's indices and values are all-gathered
(padded to the largest count, after one all-gather of the counts), concatenated
in rank order and coalesced, which sums entries with equal indices. Every rank
computes the same coalesce of the same data, so the results are bit-identical.
Traffic is p times the largest rank's nonzeros, which is what gloo moves too.
"""

from __future__ import annotations

import torch

from .._process_group.process_group import ProcessGroup
from .._process_group.reduce_op import RedOpType, ReduceOp
from .._process_group.work import Work
from .collectives import all_gather


def sparse_all_reduce(pg: ProcessGroup, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work | None:
    """``all_reduce`` of a sparse COO ``tensor`` over ``pg``; runs now, even with ``async_op``."""
    if op is not RedOpType.SUM:
        raise RuntimeError("all_reduce: unsupported reduction operation (allreduce of sparse tensors only works "
                           "with ReduceOp.SUM)")
    local = tensor.detach().coalesce()
    indices, values = local.indices(), local.values()
    count = torch.tensor([indices.shape[1]], dtype=torch.int64)
    counts = [torch.empty_like(count) for _ in range(pg.size())]
    all_gather(counts, count, group=pg)
    counts = [int(c.item()) for c in counts]
    most = max(counts)
    padded_indices = indices.new_zeros((indices.shape[0], most))
    padded_indices[:, :indices.shape[1]] = indices
    padded_values = values.new_zeros((most, *values.shape[1:]))
    padded_values[:values.shape[0]] = values
    all_indices = [torch.empty_like(padded_indices) for _ in counts]
    all_values = [torch.empty_like(padded_values) for _ in counts]
    all_gather(all_indices, padded_indices, group=pg)
    all_gather(all_values, padded_values, group=pg)
    total = torch.sparse_coo_tensor(torch.cat([i[:, :n] for i, n in zip(all_indices, counts)], dim=1),
                                    torch.cat([v[:n] for v, n in zip(all_values, counts)]),
                                    tensor.shape, check_invariants=True).coalesce()  # peers' indices: checked
    with torch.no_grad():
        tensor.copy_(total)
    work = Work.completed("all_reduce", [tensor])
    return work if async_op else None
