"""Model averagers: bring diverged replicas back to their mean, every few steps.

Local SGD (see :mod:`~torchdist.algorithms.ddp_comm_hooks.post_localSGD_hook`)
averages gradients within a node or not at all, so the replicas drift apart. An
averager, called after every optimizer step, all-reduces the parameters
themselves instead, but only every ``period`` steps: one all-reduce of the
model per ``period`` steps in place of one of the gradients per step.

:class:`PeriodicModelAverager` with ``warmup_steps=w``, ``period=p`` averages
after the calls numbered (from 0) ``w``, ``w + p``, ``w + 2p``, ...; ``w`` should
equal the hook's ``start_localSGD_iter``, during which DDP keeps the replicas equal.
"""

import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from ..._c10d.world import WORLD
from ..._process_group.process_group import ProcessGroup
from . import utils

__all__ = ["ModelAverager", "PeriodicModelAverager"]


class ModelAverager(ABC):
    """Base class of the averagers: a group (``None``: the default group, which must exist) and a step count."""

    def __init__(self, process_group: ProcessGroup | None = None):
        if process_group is None and WORLD.default_pg is None:
            # PyTorch's type and message (its not_none check on group.WORLD), and what to do
            raise TypeError("Invariant encountered: value was None when it should not be (the default process "
                            "group has not been initialized; call init_process_group first)")
        self.process_group = process_group if process_group is not None else WORLD.default_pg
        self.step = 0

    @abstractmethod
    def average_parameters(self, params):
        raise NotImplementedError


class PeriodicModelAverager(ModelAverager):
    """Average the parameters over ``process_group`` every ``period`` steps once ``warmup_steps`` have passed.

    Post-local SGD (Lin et al., ICLR 2020, arXiv:1808.07217)::

        state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=100)
        ddp_model.register_comm_hook(state, post_localSGD_hook)
        averager = PeriodicModelAverager(period=4, warmup_steps=100)
        for batch in batches:
            ...
            optimizer.step()
            averager.average_parameters(ddp_model.parameters())

    ``period=1`` works but warns: DDP's all-reduce of the gradients costs no more.
    """

    def __init__(self, period: int, warmup_steps: int = 0, process_group: ProcessGroup | None = None):
        super().__init__(process_group)
        if warmup_steps < 0:
            raise ValueError("Arg ``warmup_steps`` must be a non-negative number.")
        self.warmup_steps = warmup_steps
        if period < 1:
            raise ValueError("Arg ``period`` must be a positive value.")
        if period == 1:
            warnings.warn(
                "When period is 1, no need to use model averaging because the communication cost of all-reducing "
                "parameters will be no less than the cost of all-reducing gradients by DistributedDataParallel in "
                "the backward pass. Therefore, only DistributedDataParallel should be used for this case.",
                stacklevel=2,
            )
        self.period = period

    def average_parameters(
        self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]]
    ) -> None:
        """Count a step; on an averaging step, average ``params`` (a model's parameters or an optimizer's
        parameter groups; only those with a gradient)."""
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            utils.average_parameters_or_parameter_groups(params, self.process_group)
        self.step += 1
