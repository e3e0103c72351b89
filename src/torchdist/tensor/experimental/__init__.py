"""``torchdist.tensor.experimental``: PyTorch's experimental DTensor helpers.

``implicit_replication`` (plain tensors count as replicated), ``local_map`` (a plain-tensor function run on local
blocks) and ``register_sharding`` (a user's sharding strategies for an op). PyTorch's ``context_parallel`` is not
provided.
"""

from ._func_map import local_map
from ._implicit import implicit_replication
from ._register_sharding import register_sharding

__all__ = ["implicit_replication", "local_map", "register_sharding"]
