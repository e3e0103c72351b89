"""The communication schedule of each algorithm: who sends how many bytes to whom.

Recorded by the loopback transport's recording variant; the expected numbers
are the alpha-beta costs written in each algorithm's docstring.
"""

from __future__ import annotations

import pytest
import torch

from torchdist._algorithms import direct, halving_doubling, recursive, ring, tree
from torchdist._algorithms.reduction import combiner
from torchdist._transport.loopback import RecordingFabric

from ._world import run_world

SUM = combiner("SUM", torch.float32)


def _record(world: int, fn) -> RecordingFabric:
    fabric = RecordingFabric(world)
    run_world(world, fn, fabric=fabric)
    return fabric


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_allreduce_talks_only_to_the_right_neighbour(world: int) -> None:
    n = 1000 * world  # chunks of 1000 floats
    fabric = _record(world, lambda comm, r: ring.ring_allreduce(comm, torch.ones(n), SUM))
    per_pair = fabric.bytes_between()
    # 2 (p - 1) steps, one chunk (n / p elements) each, always to rank + 1
    assert per_pair == {(r, (r + 1) % world): 2 * (world - 1) * 1000 * 4 for r in range(world)}
    assert len(fabric.log) == 2 * (world - 1) * world


@pytest.mark.parametrize("world", [2, 4, 8])
def test_recursive_doubling_swaps_whole_buffers_with_xor_partners(world: int) -> None:
    n = 256
    fabric = _record(world, lambda comm, r: recursive.recursive_doubling_allreduce(comm, torch.ones(n), SUM))
    expected = {(r, r ^ (1 << k)): n * 4 for r in range(world) for k in range(world.bit_length() - 1)}
    assert fabric.bytes_between() == expected


@pytest.mark.parametrize("world", [2, 4, 8])
def test_halving_doubling_halves_then_doubles_with_xor_partners(world: int) -> None:
    n = 1000 * world  # chunks of 1000 floats = 4000 bytes
    fabric = _record(world, lambda comm, r: halving_doubling.halving_doubling_allreduce(
        comm, torch.ones(n), SUM))
    masks = [1 << k for k in range(world.bit_length() - 1)]  # 1, 2, .., p/2
    # 2 log2 p steps per rank: reduce-scatter sends m chunks to r ^ m for m = p/2 .. 1,
    # all-gather sends m chunks to r ^ m for m = 1 .. p/2
    for r in range(world):
        sent = [(dst, nbytes) for src, dst, _, nbytes in fabric.log if src == r]
        expected = [(r ^ m, m * 4000) for m in reversed(masks)] + [(r ^ m, m * 4000) for m in masks]
        assert sent == expected, r
    # the ring's bytes: 2 (p-1)/p n per rank
    assert sum(nbytes for _, _, _, nbytes in fabric.log) == world * 2 * (world - 1) * 4000


def test_recursive_doubling_folds_in_extra_ranks_at_odd_world_sizes() -> None:
    world, n = 6, 10  # p' = 4; ranks 4 and 5 fold into 0 and 1
    fabric = _record(world, lambda comm, r: recursive.recursive_doubling_allreduce(comm, torch.ones(n), SUM))
    pairs = fabric.bytes_between()
    assert pairs[4, 0] == pairs[0, 4] == pairs[5, 1] == pairs[1, 5] == n * 4
    assert not any(4 in pair and 0 not in pair for pair in pairs)  # extras talk to their partner only
    assert {pair for pair in pairs if 4 not in pair and 5 not in pair} == \
        {(r, r ^ m) for r in range(4) for m in (1, 2)}


@pytest.mark.parametrize("world", [2, 3, 5])
def test_direct_allreduce_is_one_step_to_everyone(world: int) -> None:
    fabric = _record(world, lambda comm, r: direct.direct_allreduce(comm, torch.ones(3), SUM))
    assert fabric.bytes_between() == {(a, b): 12 for a in range(world) for b in range(world) if a != b}


@pytest.mark.parametrize("world", [3, 5])
def test_broadcasts_binomial_tree_and_pipelined_chain(world: int) -> None:
    root = 1
    fabric = _record(world, lambda comm, r: tree.binomial_broadcast(comm, torch.ones(4), root))
    senders = [src for src, _, _, _ in fabric.log]
    assert len(fabric.log) == world - 1 and senders.count(root) == (world - 1).bit_length()
    fabric = _record(world, lambda comm, r: tree.chain_broadcast(comm, torch.ones(1000), root, 1000))
    # 4000 bytes in 4 segments of 1000, each passed down the chain root -> root + 1 -> ...
    chain = {((root + i) % world, (root + i + 1) % world): 4000 for i in range(world - 1)}
    assert fabric.bytes_between() == chain and len(fabric.log) == 4 * (world - 1)


def test_pairwise_alltoall_sends_one_block_per_peer() -> None:
    world = 4

    def fn(comm, r):
        ins = [torch.ones(j + 1) for j in range(world)]
        direct.alltoall(comm, [torch.empty(r + 1) for _ in range(world)], ins, pairwise=True)
    fabric = _record(world, fn)
    assert fabric.bytes_between() == {(a, b): (b + 1) * 4 for a in range(world) for b in range(world) if a != b}
