"""Collectives in torch.profiler traces: one span per op, titled "<backend>:<op>" as gloo's, or by record_comm."""

from __future__ import annotations

import pytest
import torch

import torchdist as dist
from torchdist.testing import run_ranks


def _traced(rank: int, world: int) -> tuple[list[str], list[str]]:
    """The comm spans of a profiled run (in order), and those of an unprofiled one (none)."""
    t = torch.ones(1 << 10)
    with torch.profiler.profile() as prof:
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()  # may run on the engine's worker: titled there
        dist.broadcast(t, 0)
        with dist.record_comm("FSDP::all_gather (layer1)"):
            dist.all_gather_single(torch.empty(world * t.numel()), t)
        dist.reduce_scatter_single(torch.empty(t.numel() // world), t)
        dist.barrier()
    backend = dist.get_backend()
    spans = [e.name for e in prof.events() if e.name.startswith(f"{backend}:") or e.name.startswith("FSDP::")]
    return spans, []


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_every_op_is_one_span_titled_like_gloos(backend: str) -> None:
    for spans, _ in run_ranks(_traced, 2, backend=backend, timeout=60):
        assert spans == [f"{backend}:all_reduce", f"{backend}:all_reduce", f"{backend}:broadcast",
                         "FSDP::all_gather (layer1)", f"{backend}:reduce_scatter", f"{backend}:barrier"], spans


def test_record_comm_restores_the_title_and_is_exported_as_in_torch() -> None:
    from torchdist._process_group import profiling

    with dist.record_comm("outer"):
        with dist.record_comm("inner"):
            assert profiling._override.name == "inner"
        assert profiling._override.name == "outer"
    assert profiling._override.name is None
    assert profiling.open_span("tcp", "allreduce") is None  # no profiler running: nothing is recorded
