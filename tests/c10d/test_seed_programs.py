"""The programs of seed 003 ("PyTorch Distributed Communication Primitives"), run on
torchdist with their imports swapped, and the values they print checked.

Each ``run`` body is the seed's, with ``dist`` = torchdist and backend "gloo".
"""

import torch

import torchdist as dist
from torchdist.testing import run_ranks


def p2p(rank_id, size):
    tensor = torch.zeros(1)
    if rank_id == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
        dist.recv(tensor=tensor, src=1)
    else:
        dist.recv(tensor=tensor, src=0)
        tensor += 1
        dist.send(tensor=tensor, dst=0)
    return tensor


def broadcast(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    dist.broadcast(tensor, src=0)
    return tensor


def scatter(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    if rank_id == 0:
        scatter_list = [torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([2, 2]), torch.tensor([3, 3])]
        dist.scatter(tensor, src=0, scatter_list=scatter_list)
    else:
        dist.scatter(tensor, src=0)
    return tensor


def gather(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    if rank_id == 0:
        gather_list = [torch.zeros(2, dtype=torch.int64) for _ in range(4)]
        dist.gather(tensor, dst=0, gather_list=gather_list)
        return gather_list
    dist.gather(tensor, dst=0)
    return None


def reduce(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    dist.reduce(tensor, dst=3, op=dist.ReduceOp.SUM)
    return tensor


def all_gather(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    gather_list = [torch.zeros(2, dtype=torch.int64) for _ in range(4)]
    dist.all_gather(gather_list, tensor)
    return gather_list


def all_reduce(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


INPUTS = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6]), torch.tensor([7, 8])]


def test_p2p_ping_pong():
    assert [t.item() for t in run_ranks(p2p, 2, backend="gloo")] == [2.0, 2.0]


def test_broadcast():
    for t in run_ranks(broadcast, 4, backend="gloo"):
        assert t.tolist() == [1, 2]


def test_scatter():
    assert [t.tolist() for t in run_ranks(scatter, 4, backend="gloo")] == [[0, 0], [1, 1], [2, 2], [3, 3]]


def test_gather():
    results = run_ranks(gather, 4, backend="gloo")
    assert [t.tolist() for t in results[0]] == [t.tolist() for t in INPUTS]
    assert results[1:] == [None, None, None]


def test_reduce_lands_on_dst():
    assert run_ranks(reduce, 4, backend="gloo")[3].tolist() == [16, 20]


def test_all_gather():
    for gathered in run_ranks(all_gather, 4, backend="gloo"):
        assert [t.tolist() for t in gathered] == [t.tolist() for t in INPUTS]


def test_all_reduce():
    for t in run_ranks(all_reduce, 4, backend="gloo"):
        assert t.tolist() == [16, 20]
