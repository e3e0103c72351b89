"""``Join``: training with uneven inputs across ranks (``torch.distributed.algorithms.Join``).

When ranks get different numbers of batches, a rank that runs out would stop
issuing the collectives the others wait for, and they would hang. Inside a
``Join`` context every iteration of a rank that still has data starts with an
all-reduce of a 1 (:meth:`Join.notify_join_context`, called by the joinable's
own forward or step). A rank that has run out leaves the ``with`` body and, in
``__exit__``, loops::

    all-reduce a 0 ──▶ sum == 0: every rank has joined ──▶ post hooks, leave
         │
         └─ sum > 0: others still train ──▶ each JoinHook.main_hook() shadows the
                                           collectives of one of their iterations

With ``throw_on_early_termination`` the first rank to run out all-reduces a 1
instead of shadowing and raises ``RuntimeError("Rank r exhausted all inputs.")``;
the others see it in their notify step and raise too. An exception raised inside
the ``with`` body propagates unchanged (no shadowing is attempted).
"""

from __future__ import annotations

import abc
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .._c10d.collectives import all_reduce

__all__ = ["Join", "JoinHook", "Joinable"]

logger = logging.getLogger(__name__)


class JoinHook:
    """What a joined rank runs on behalf of one ``Joinable``; both hooks default to doing nothing."""

    def main_hook(self) -> None:
        """Shadow the collectives of one training iteration of the ranks that have not joined."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Runs once every rank has joined; ``is_last_joiner`` is True on the ranks that joined last."""


@dataclass(frozen=True)
class _JoinConfig:
    enable: bool = False
    throw_on_early_termination: bool = False
    is_first_joinable: bool = False


class Joinable(abc.ABC):
    """A class whose per-iteration collectives can be shadowed by a ``JoinHook``."""

    def __init__(self) -> None:
        super().__init__()
        self._join_config = _JoinConfig()

    @abc.abstractmethod
    def join_hook(self, **kwargs) -> JoinHook:
        """The hook that shadows this object's collectives on a joined rank."""

    @property
    @abc.abstractmethod
    def join_device(self) -> torch.device:
        """The device of the join context's small all-reduces."""

    @property
    @abc.abstractmethod
    def join_process_group(self) -> Any:
        """The process group of the join context's all-reduces."""


class Join:
    """Context manager for uneven inputs: ``with Join([ddp_model, zero_optim]): ...``."""

    #: Iterations of shadowing after which a warning says that one rank is far behind.
    WARN_THRESHOLD = 1000

    def __init__(self, joinables: list[Joinable], enable: bool = True, throw_on_early_termination: bool = False,
                 **kwargs) -> None:
        if len(joinables) == 0:
            raise ValueError("The join context manager requires at least one joinable")
        self._joinables = list(joinables)
        self._join_hooks = [j.join_hook(**kwargs) for j in self._joinables]
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination
        self._set_joinable_configs()
        self._extract_dist_info()

    def _set_joinable_configs(self) -> None:
        for i, joinable in enumerate(self._joinables):
            joinable._join_config = _JoinConfig(self._enable, self._throw_on_early_termination, i == 0)

    def _extract_dist_info(self) -> None:
        groups = {id(j.join_process_group) for j in self._joinables}
        if len(groups) > 1:
            raise ValueError("Using join context manager with multiple process groups")
        devices = {str(j.join_device) for j in self._joinables}
        if len(devices) > 1:
            raise ValueError(f"Join: all joinables must use one device, got {sorted(devices)}")
        self._process_group = self._joinables[0].join_process_group
        self._device = self._joinables[0].join_device
        self._rank = self._process_group.rank()

    def __enter__(self) -> "Join":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if not self._enable or exc_type is not None:
            self._set_joinable_configs_disabled()
            return  # an exception in the body propagates unchanged
        is_last_joiner = True
        iterations = 0
        try:
            while True:
                if self._get_num_nonjoined_procs() == 0:
                    break
                if self._throw_on_early_termination:
                    self._notify_procs_to_terminate()
                for hook in self._join_hooks:
                    hook.main_hook()
                is_last_joiner = False
                iterations += 1
                if iterations == self.WARN_THRESHOLD:
                    warnings.warn(f"Detected uneven input skew of greater than {self.WARN_THRESHOLD}. This means "
                                  f"that rank {self._rank} has at least {self.WARN_THRESHOLD} fewer inputs than "
                                  "other currently-active ranks. This level of skew could lead to performance "
                                  "degradation during training.")
            for hook in self._join_hooks:
                hook.post_hook(is_last_joiner)
        finally:
            self._set_joinable_configs_disabled()

    def _set_joinable_configs_disabled(self) -> None:
        for joinable in self._joinables:
            joinable._join_config = _JoinConfig()

    def _get_num_nonjoined_procs(self) -> int:
        count = torch.zeros(1, device=self._device)
        all_reduce(count, group=self._process_group)
        return int(count.item())

    def _notify_procs_to_terminate(self) -> None:
        ones = torch.ones(1, device=self._device)
        all_reduce(ones, group=self._process_group)
        raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")

    @staticmethod
    def notify_join_context(joinable: Joinable):
        """Called by a joinable at the start of each iteration; returns the async all-reduce's Work or None."""
        if not hasattr(joinable, "_join_config"):
            raise AssertionError(f"Check that the {type(joinable)} constructor calls the ``Joinable`` constructor")
        config = joinable._join_config
        if not config.is_first_joinable or not config.enable:
            return None
        device, group = joinable.join_device, joinable.join_process_group
        work = all_reduce(torch.ones(1, device=device), group=group, async_op=True)
        if config.throw_on_early_termination:
            zeros = torch.zeros(1, device=device)
            all_reduce(zeros, group=group)
            if zeros.item():
                raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        return work
