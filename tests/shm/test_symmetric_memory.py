"""Symmetric memory (``torchdist.symmetric_memory``): tensors every rank of a one-host group reads
directly, and the collectives that use them without copying through the board's regions.

Values are checked against torch computed locally and must be bit-identical on every
rank, at world sizes 1-4 with slices that do not divide evenly; a rank passing an
ordinary tensor where the others pass a symmetric one raises on every rank; nothing
is left in /dev/shm.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import torchdist
from torchdist._transport.shm_segment import PREFIX, shm_dir, supported
from torchdist.errors import DistBackendError
from torchdist.testing import run_ranks

pytestmark = pytest.mark.skipif(supported() is not None, reason=str(supported()))

N = (1 << 18) + 3  # 1 MiB of float32 and a bit: above SMALL_BYTES, slices of unequal size


def _data(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g).to(dtype)


def _collectives(rank: int, world: int) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    out = []
    buf = torchdist.symmetric_memory.empty(N, dtype=torch.float32)
    assert torchdist.symmetric_memory.is_symmetric(buf) and not torchdist.symmetric_memory.is_symmetric(_data(0, 4))
    assert buf.shape == (N,) and torch.count_nonzero(buf) == 0
    inputs = [_data(r, N) for r in range(world)]
    expected = torch.stack(inputs).double().sum(0)
    for op, want in ((torchdist.ReduceOp.SUM, expected), (torchdist.ReduceOp.AVG, expected / world),
                     (torchdist.ReduceOp.MAX, torch.stack(inputs).max(0).values.double())):
        buf.copy_(inputs[rank])
        torchdist.all_reduce(buf, op=op)
        assert torch.allclose(buf.double(), want, atol=1e-4), op
        out.append(buf.clone())
    # an offset view of the same allocation, async
    view = buf[5:5 + (N - 10)]
    view.copy_(inputs[rank][5:5 + (N - 10)])
    torchdist.all_reduce(view, async_op=True).wait()
    assert torch.allclose(view.double(), expected[5:5 + (N - 10)], atol=1e-4)
    out.append(view.clone())
    for root in range(world):
        buf.copy_(inputs[rank])
        torchdist.broadcast(buf, src=root)
        assert torch.equal(buf, inputs[root])
    gathered = torchdist.symmetric_memory.empty(world, N, dtype=torch.float32)
    torchdist.all_gather_into_tensor(gathered, inputs[rank])
    assert torch.equal(gathered, torch.stack(inputs))
    # reduce-scatter from a symmetric input: every rank's input is the gathered rows times (rank + 1)
    gathered.mul_(rank + 1)
    chunk = torch.empty(N)
    torchdist.reduce_scatter_tensor(chunk, gathered.view(-1))
    assert torch.allclose(chunk.double(), inputs[rank].double() * (world * (world + 1) // 2), atol=1e-4)
    # other dtypes share the allocator
    ints = torchdist.symmetric_memory.empty((2, N), dtype=torch.int64)
    ints.copy_(torch.arange(2 * N).view(2, N) * (rank + 1))
    torchdist.all_reduce(ints)
    assert torch.equal(ints, torch.arange(2 * N).view(2, N) * (world * (world + 1) // 2))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_on_symmetric_tensors_match_torch_bit_for_bit(world: int) -> None:
    before = _ours()
    results = run_ranks(_collectives, world, backend="shm", timeout=120)
    for result in results:
        for a, b in zip(result, results[0]):
            assert torch.equal(a, b)
    assert _ours() <= before


def _mixed(rank: int, world: int, op: str) -> tuple[str, float]:
    """Rank 0's tensor in symmetric memory, rank 1's an ordinary one (allocating is collective)."""
    def tensor(*shape: int) -> torch.Tensor:
        symmetric = torchdist.symmetric_memory.empty(*shape)
        return symmetric if rank == 0 else torch.zeros(*shape)
    run = {"all_reduce": lambda: torchdist.all_reduce(tensor(N)),
           "broadcast": lambda: torchdist.broadcast(tensor(N), src=0),
           "all_gather_single": lambda: torchdist.all_gather_single(tensor(world * N), torch.zeros(N)),
           "reduce_scatter_single": lambda: torchdist.reduce_scatter_single(torch.zeros(N), tensor(world * N))}[op]
    start = time.monotonic()
    with pytest.raises(DistBackendError) as info:
        run()
    return str(info.value), time.monotonic() - start


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single"])
def test_a_rank_passing_an_ordinary_tensor_raises_on_every_rank(op: str) -> None:
    """Also shows that each op takes the symmetric path: the ordinary one would not notice."""
    for message, elapsed in run_ranks(_mixed, 2, args=(op,), backend="shm", timeout=60):
        assert elapsed < 5, message
        assert "mismatch" in message and "symmetric allocation #0" in message and "an ordinary tensor" in message


def _different_sizes(rank: int, world: int) -> str:
    with pytest.raises(DistBackendError) as info:
        torchdist.symmetric_memory.empty(100 + rank)
    return str(info.value)


def test_ranks_asking_for_different_sizes_get_a_clear_error() -> None:
    for message in run_ranks(_different_sizes, 2, backend="shm", timeout=60):
        assert "symmetric allocation #0" in message and "same sizes in the same order" in message, message


def _on_tcp(rank: int, world: int) -> str:
    with pytest.raises(RuntimeError) as info:
        torchdist.symmetric_memory.empty(4)
    return str(info.value)


def test_a_group_not_on_shared_memory_says_so() -> None:
    for message in run_ranks(_on_tcp, 2, backend="tcp", timeout=60):
        assert "one host" in message and "'shm'" in message


def _outside_the_group(rank: int, world: int) -> str | None:
    import warnings

    group = torchdist.new_group([0])
    if rank == 0:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not warned about and then refused
        with pytest.raises(ValueError) as info:
            torchdist.symmetric_memory.empty(4, group=group)
    return str(info.value)


def test_a_rank_outside_the_group_is_refused_without_a_warning() -> None:
    message = run_ranks(_outside_the_group, 2, backend="shm", timeout=60)[1]
    assert message.startswith("symmetric_memory.empty: Invalid process group specified: rank 1"), message


def _ours() -> set[str]:
    return {n for n in os.listdir(shm_dir()) if n.startswith(PREFIX)}


def _mapped_and_fds() -> tuple[int, int]:
    with open("/proc/self/maps") as maps:
        mapped = sum(PREFIX in line for line in maps)
    return mapped, len(os.listdir("/proc/self/fd"))


def _freed_with_their_last_tensor(rank: int, world: int) -> dict:
    import gc

    torch.set_num_threads(1)
    out = {"start": _mapped_and_fds()}
    buf = torchdist.symmetric_memory.empty(N)
    view = buf[7:]  # a view keeps the allocation, and collectives on it still take the direct path
    del buf
    gc.collect()
    view.fill_(rank + 1)
    torchdist.all_reduce(view)
    out["view_sum"] = view[0].item()
    out["held"] = _mapped_and_fds()
    del view
    gc.collect()
    out["freed"] = _mapped_and_fds()
    for _ in range(20):  # a training loop that makes a new DDP each time (every bucket in symmetric memory)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])
        ddp = torchdist.DistributedDataParallel(model, bucket_cap_mb=0.25)
        ddp(torch.ones(2, 128)).sum().backward()
        del ddp, model
        gc.collect()
    out["after_ddps"] = _mapped_and_fds()
    return out


def test_an_allocation_is_freed_with_its_last_tensor_and_ddp_can_be_made_again_and_again() -> None:
    for rank, out in enumerate(run_ranks(_freed_with_their_last_tensor, 2, backend="shm", timeout=120)):
        world = 2
        assert out["view_sum"] == world * (world + 1) // 2
        (start_maps, start_fds), (held_maps, held_fds) = out["start"], out["held"]
        assert held_maps == start_maps + world, out  # this rank's segment and the peer's
        assert out["freed"] == out["start"], out
        maps, fds = out["after_ddps"]
        assert maps == start_maps and fds <= start_fds + 2, out  # (torch may open a file or two)
