"""``torchdist.tensor.experimental``: PyTorch's experimental DTensor helpers.

``implicit_replication`` (plain tensors count as replicated), ``local_map`` (a plain-tensor function run on local
blocks), ``register_sharding`` (a user's sharding strategies for an op) and ``context_parallel`` (ring attention
over a sequence-sharded mesh, CPU included).
"""

from ._attention import context_parallel
from ._func_map import local_map
from ._implicit import implicit_replication
from ._register_sharding import register_sharding

__all__ = ["context_parallel", "implicit_replication", "local_map", "register_sharding"]
