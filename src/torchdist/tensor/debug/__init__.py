"""``torchdist.tensor.debug``, PyTorch's ``torch.distributed.tensor.debug``: :class:`CommDebugMode` counts the
collectives a block of code issues (``_comm_mode``, per module via ``_module_tracker``); :func:`visualize_sharding`
prints which rank holds which block of a DTensor (``_visualize_sharding``). See docs/design/dtensor.md."""

from ._comm_mode import CommDebugMode
from ._visualize_sharding import visualize_sharding

__all__ = ["CommDebugMode", "visualize_sharding"]
