"""``torchdist.tensor.parallel``: tensor parallelism, PyTorch's ``torch.distributed.tensor.parallel``.

Modules: ``_style`` (the ParallelStyles: how a module's parameters, inputs and
outputs are laid out), ``_api`` (``parallelize_module``: plans by submodule
path), ``_loss`` (``loss_parallel``: cross-entropy on class-sharded logits).
See docs/design/tensor_parallel.md.
"""

from ._api import parallelize_module
from ._loss import loss_parallel
from ._style import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput,
                     PrepareModuleOutput, RowwiseParallel, SequenceParallel)

__all__ = [
    "ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput",
    "RowwiseParallel", "SequenceParallel", "parallelize_module", "loss_parallel",
]
