"""``DistributedSampler``: each rank reads its own, equally long, part of a data set.

With ``N`` samples and ``R`` replicas, rank ``r`` takes ``indices[r::R]`` of a
list of ``total_size = R * num_samples`` indices, where

- ``num_samples = ceil(N / R)`` and the list is padded by repeating it from the
  start (every sample is seen, a few twice), or
- with ``drop_last`` and ``N % R != 0``: ``num_samples = ceil((N - R) / R)`` and
  the list is truncated (every rank sees distinct samples, a few are skipped).

With ``shuffle`` the list is a permutation drawn from a generator seeded with
``seed + epoch``, the same on every rank; call ``set_epoch(epoch)`` before each
epoch to get a new one. PyTorch's semantics exactly, so the same seed gives the
same split as ``torch.utils.data.distributed.DistributedSampler``.
"""

from __future__ import annotations

import math
from typing import Iterator, Sized, TypeVar

import torch
from torch.utils.data import Sampler

from ..._c10d.init import get_rank, get_world_size

__all__ = ["DistributedSampler"]

T_co = TypeVar("T_co", covariant=True)


class DistributedSampler(Sampler[T_co]):
    """Restricts data loading to this rank's share of ``dataset`` (see the module docstring)."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        # Before init_process_group, get_world_size/get_rank raise ValueError, as PyTorch's do.
        if num_replicas is None:
            num_replicas = get_world_size()
        if rank is None:
            rank = get_rank()
        if rank >= num_replicas or rank < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        n = len(dataset)
        if self.drop_last and n % self.num_replicas != 0:
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.shuffle = shuffle
        self.seed = seed

    def __iter__(self) -> Iterator[T_co]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if padding <= len(indices):
                indices += indices[:padding]
            else:
                indices += (indices * math.ceil(padding / len(indices)))[:padding]
        else:
            indices = indices[:self.total_size]
        if len(indices) != self.total_size:  # PyTorch's assertion, and why it fails
            raise AssertionError(f"Number of indices ({len(indices)}) does not match total_size ({self.total_size}): "
                                 "the dataset's length changed after the DistributedSampler was made; make a new one")
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use a new shuffle for the next iteration (seed + epoch); call it on every rank, before each epoch."""
        self.epoch = epoch
