"""Averaging parameters across a group: the one collective every model averager runs.

All parameters are flattened into one buffer, divided by the group size and
all-reduced in a single operation (one latency instead of one per parameter, at
the cost of a copy of the parameters). Each parameter's ``.data`` then becomes
its slice of that buffer, cast back to its dtype, as in PyTorch.

Which parameters: those with a gradient. A parameter without one took no part
in the step (frozen, or unused this iteration) and is left as it is; every rank
must agree on which those are, or the all-reduce pairs different buffers.
"""

import itertools
from collections.abc import Iterable, Iterator

import torch

from ..._c10d.collectives import all_reduce
from ..._c10d.init import get_world_size
from ..._c10d.world import NON_GROUP_MEMBER
from ..._process_group.process_group import ProcessGroup

__all__ = ["average_parameters", "get_params_to_average", "average_parameters_or_parameter_groups"]


def average_parameters(params: Iterator[torch.nn.Parameter], process_group: ProcessGroup | None) -> None:
    """Replace each of ``params`` (tensors) by its mean over ``process_group`` (``None``: the default group).

    A rank outside the group does nothing.
    """
    if process_group is NON_GROUP_MEMBER:
        return
    for_flattening, for_unflattening = itertools.tee(params)
    flat = torch.cat([p.data.reshape(-1) for p in for_flattening])
    flat /= get_world_size(process_group)
    all_reduce(flat, group=process_group)
    offset = 0
    for p in for_unflattening:
        p.data = flat[offset:offset + p.numel()].view_as(p).type_as(p)
        offset += p.numel()


def get_params_to_average(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
) -> list[torch.nn.Parameter]:
    """The parameters with a gradient among ``params``: a model's parameters or an optimizer's parameter groups.

    Raises NotImplementedError for anything else, plain tensors included (as PyTorch does).
    """
    kept = []
    for entry in params:
        if isinstance(entry, torch.nn.Parameter):
            if entry.grad is not None:
                kept.append(entry)
        elif isinstance(entry, dict):
            kept.extend(p for p in entry["params"] if p.grad is not None)
        else:
            raise NotImplementedError(f"Parameter input of type {type(entry)} is not supported")
    return kept


def average_parameters_or_parameter_groups(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
    process_group: ProcessGroup | None,
) -> None:
    """Average the parameters with a gradient among a model's parameters or an optimizer's parameter groups."""
    average_parameters(iter(get_params_to_average(params)), process_group)
