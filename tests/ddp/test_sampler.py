"""DistributedSampler: PyTorch's split, padding, drop_last, shuffling (inventory 80)."""

from __future__ import annotations

import pytest
import torch.utils.data.distributed as torch_distributed_data

from torchdist.utils.data import DistributedSampler
from torchdist.testing import run_ranks


@pytest.mark.parametrize("n", [10, 11, 12, 3])
@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_split_matches_pytorch(n, replicas, drop_last, shuffle):
    data = list(range(n))
    shares = []
    for rank in range(replicas):
        ours = DistributedSampler(data, replicas, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        theirs = torch_distributed_data.DistributedSampler(data, replicas, rank, shuffle=shuffle, seed=7,
                                                           drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs), (rank, epoch)
        assert len(ours) == len(theirs)
        shares.append(list(ours))
    assert len({len(s) for s in shares}) == 1, "every rank gets the same number of samples"
    union = {i for s in shares for i in s}
    if not drop_last:
        assert union == set(data)
    else:
        assert len(union) == replicas * len(shares[0])


def test_no_shuffle_takes_every_rth_index_and_pads_from_start():
    assert list(DistributedSampler(range(5), 2, 0, shuffle=False)) == [0, 2, 4]
    assert list(DistributedSampler(range(5), 2, 1, shuffle=False)) == [1, 3, 0]
    assert list(DistributedSampler(range(5), 2, 1, shuffle=False, drop_last=True)) == [1, 3]


def test_set_epoch_changes_permutation_deterministically():
    s = DistributedSampler(range(100), 2, 0)
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    assert first != second
    s.set_epoch(0)
    assert list(s) == first


def test_invalid_rank_raises():
    with pytest.raises(ValueError, match="Invalid rank"):
        DistributedSampler(range(4), 2, 2)
    with pytest.raises(ValueError, match="Invalid rank"):
        DistributedSampler(range(4), 2, -1)
    with pytest.raises(ValueError, match=r"interval \[0, -1\]"):  # PyTorch's wording for num_replicas=0
        DistributedSampler(range(4), 0, 0)
    with pytest.raises(ValueError, match="has not been initialized"):  # defaults need a group, as in PyTorch
        DistributedSampler(range(4))


def test_a_dataset_that_grew_fails_pytorchs_assertion():
    data = list(range(12))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)
    data.extend(range(12, 27))
    with pytest.raises(AssertionError, match=r"Number of indices \(\d+\) does not match total_size \(12\)"):
        iter(sampler)


def _defaults(rank, world_size):
    import torchdist

    s = DistributedSampler(range(10))
    torchdist.barrier()
    return s.num_replicas, s.rank, list(s)


def test_defaults_come_from_the_default_group():
    results = run_ranks(_defaults, 3, backend="gloo")
    assert [r[:2] for r in results] == [(3, 0), (3, 1), (3, 2)]
    got = [i for r in results for i in r[2]]
    assert len(got) == 12 and set(got) == set(range(10)), got
