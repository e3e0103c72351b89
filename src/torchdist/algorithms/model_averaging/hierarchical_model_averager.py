"""Hierarchical model averaging: small groups average often, larger groups less often.

Hierarchical SGD (arXiv:2010.12998, the paper PyTorch's averager cites) extends
post-local SGD's two levels to any number. ``period_group_size_dict`` maps
periods, ascending, to group sizes, the last being the whole ``process_group``;
e.g. ``{4: 8, 16: 16}`` over 16 ranks: ranks 0-7 and 8-15 average every 4
steps, all 16 every 16 steps. The groups of each level are consecutive blocks
of ranks (``new_subgroups(group_size, group=process_group)``), made by every rank
in the constructor.

At each step from ``warmup_steps`` on (steps counted from 0, the warm-up
included), only the level with the largest period that divides the step
averages: the larger group covers the smaller ones, so averaging within them
too would repeat work. The intra-node level is the post-local SGD hook's
``subgroup``, not one of these levels.
"""

import logging
import warnings
from collections import OrderedDict
from collections.abc import Iterable

import torch

from ..._c10d.groups import new_subgroups
from ..._c10d.init import get_world_size
from ..._process_group.process_group import ProcessGroup
from . import utils
from .averagers import ModelAverager

__all__ = ["HierarchicalModelAverager"]

logger = logging.getLogger(__name__)


class HierarchicalModelAverager(ModelAverager):
    """Average the parameters at several levels of a hierarchy of groups, each with its own period.

    ``period_group_size_dict``: periods to group sizes, in ascending period order; the last
    size must be the size of ``process_group`` (``None``: the default group). Experimental
    in PyTorch, as here.
    """

    def __init__(self, period_group_size_dict: "OrderedDict[int, int] | dict[int, int] | None" = None,
                 warmup_steps: int = 0, process_group: ProcessGroup | None = None):
        super().__init__(process_group)
        if not period_group_size_dict:
            raise ValueError("Arg ``period_group_size_dict`` must not be empty.")
        self._periods = list(period_group_size_dict.keys())
        if self._periods[0] <= 0:
            raise ValueError("The minimum period in arg ``period_group_size_dict`` must be a positive value.")
        if self._periods[-1] == 1:
            warnings.warn(
                "When the maximum period in arg ``period_group_size_dict`` is 1, no need to use model averaging "
                "because the communication cost of all-reducing parameters will be no less than the cost of "
                "all-reducing gradients by DistributedDataParallel in the backward pass. Therefore, only "
                "DistributedDataParallel should be used for this case.",
                stacklevel=2,
            )
        overall_size = get_world_size(group=self.process_group)
        last_size = list(period_group_size_dict.values())[-1]
        if last_size != overall_size:
            raise ValueError(f"The last value in arg ``period_group_size_dict`` {last_size} must be equal to the "
                             f"size of arg ``process_group`` {overall_size}.")
        self.period_process_group_dict: OrderedDict[int, ProcessGroup] = OrderedDict()
        logger.info("Model averaging hierarchy:")
        for period, group_size in period_group_size_dict.items():
            logger.info("\tEach group that has %s processes average parameters every %s iterations, "
                        "if no higher-level averaging.", group_size, period)
            if group_size != overall_size:
                self.period_process_group_dict[period], _ = new_subgroups(group_size=group_size,
                                                                          group=self.process_group)
            else:
                self.period_process_group_dict[period] = self.process_group
        if warmup_steps < 0:
            raise ValueError("Arg ``warmup_steps`` must be a non-negative number.")
        self.warmup_steps = warmup_steps

    def _find_process_group(self) -> ProcessGroup | None:
        """The group of the largest period that divides ``step``; None if none does."""
        for period in reversed(self._periods):
            if self.step % period == 0:
                return self.period_process_group_dict[period]
        return None

    def average_parameters(
        self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]]
    ) -> None:
        """Count a step; after the warm-up, average ``params`` within the group of the largest period dividing it."""
        if self.step >= self.warmup_steps:
            group = self._find_process_group()
            if group is not None:
                utils.average_parameters_or_parameter_groups(params, group)
        self.step += 1
