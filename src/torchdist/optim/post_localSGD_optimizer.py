"""``PostLocalSGDOptimizer``: a local optimizer followed by a model averager, as one optimizer.

Post-local SGD (Lin et al., ICLR 2020, arXiv:1808.07217) needs a model averager
run after every optimizer step (see
:mod:`torchdist.algorithms.model_averaging.averagers`); this wrapper does that
in ``step()``, and saves the averager's step count in ``state_dict()`` under
``"step"``, so that a reloaded run does not warm up again. Everything else is
the wrapped optimizer's: its ``param_groups`` and ``state`` are this object's.

It is a ``torch.optim.Optimizer`` by type only, as in PyTorch: ``Optimizer.__init__``
is not run, and the wrapped optimizer does the work (its hooks are the ones that run).
"""

import warnings
from typing import Any

import torch

from ..algorithms.model_averaging.averagers import ModelAverager

__all__ = ["PostLocalSGDOptimizer"]


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Step ``optim``, then let ``averager`` average the parameters (periodically, after its warm-up)::

        opt = PostLocalSGDOptimizer(torch.optim.SGD(ddp_model.parameters(), lr=0.01),
                                    averagers.PeriodicModelAverager(period=4, warmup_steps=100))

    The averager's ``warmup_steps`` should equal the post-local SGD hook's ``start_localSGD_iter``.
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager):
        self.optim = optim
        self.param_groups = self.optim.param_groups
        self.averager = averager

    @property
    def state(self):  # type: ignore[override]
        return self.optim.state

    def __repr__(self) -> str:
        return self.optim.__repr__()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, plus the averager's step count under ``"step"``."""
        state_dict = self.optim.state_dict()
        state_dict["step"] = self.averager.step
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state and the averager's step (0, with a warning, if absent)."""
        self.optim.load_state_dict(state_dict)
        if "step" in state_dict:
            self.averager.step = state_dict["step"]
        else:
            warnings.warn("Loaded state dict does not contain a step counter for an averager. "
                          "Setting step counter to 0.", stacklevel=2)
            self.averager.step = 0

    def step(self) -> None:  # type: ignore[override]
        """One step of the wrapped optimizer, then one of the averager (which may average the parameters)."""
        self.optim.step()
        self.averager.average_parameters(params=self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)
