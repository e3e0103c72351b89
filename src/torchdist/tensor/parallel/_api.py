"""``parallelize_module``: apply a ParallelStyle, or a plan of styles by submodule path, to a module.

A plan key is a dotted path whose parts are fnmatch patterns over child names
(``"layers.*.attention.wq"``); each part is matched level by level, so one key
may reach many submodules. A key that matches nothing is skipped with a
warning, as in PyTorch; the empty key means the module itself.
"""

from __future__ import annotations

import warnings
from fnmatch import fnmatch

import torch.nn as nn

from ...device_mesh import DeviceMesh
from ...device_mesh._mesh import _mesh_resources
from ._style import ParallelStyle

__all__ = ["parallelize_module"]


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                       parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None, *,
                       src_data_rank: int | None = 0) -> nn.Module:
    """Lay ``module`` (or the submodules the plan names) out over the 1-D ``device_mesh`` and return it.

    ``src_data_rank`` is the group rank whose parameters every rank gets (scattered or broadcast);
    ``None`` keeps each rank's own values and cuts them locally, without communication.
    """
    mesh = device_mesh or _mesh_resources.get_current_mesh()
    if parallelize_plan is None:
        warnings.warn("No parallelize_plan is provided and auto-parallel is not supported at the moment, so this "
                      "parallelize_module call will do nothing.", stacklevel=2)
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.src_data_rank = src_data_rank
        return parallelize_plan._apply(module, mesh)
    if not isinstance(parallelize_plan, dict):
        raise TypeError("Expect Union[ParallelStyle, Dict[str, ParallelStyle]] for parallelize_plan, "
                        f"{type(parallelize_plan)} found!")
    for path, style in parallelize_plan.items():
        if path == "":
            # As PyTorch: an empty key applies the style with the default src_data_rank (0), not the caller's.
            parallelize_module(module, mesh, style)
            continue
        head, _, rest = path.partition(".")
        matched = [child for name, child in module.named_children() if fnmatch(name, head)]
        if not matched:
            warnings.warn(f"Parallelize plan key '{path}' could not be resolved: no submodule matching token "
                          f"'{head}' in module {module}, skipping this plan entry.", stacklevel=2)
            continue
        for child in matched:
            parallelize_module(child, mesh, {rest: style} if rest else style, src_data_rank=src_data_rank)
    return module
