"""Context parallelism: the sequence sharded over ranks, attention computed by ring attention (CPU included).

``_attention``: ``context_parallel``, ``context_parallel_unshard``, ``set_rotate_method`` and the options;
``_ring``: the ring attention math, forward and backward; ``_load_balance``: which positions each rank keeps.
"""

from ._attention import (_context_parallel_shard, _cp_options, _RotateMethod,
                         context_parallel, context_parallel_unshard, set_rotate_method)
from ._load_balance import _HeadTailLoadBalancer, _LoadBalancer
from ._options import _ContextParallelOptions

__all__ = [
    "_context_parallel_shard",
    "_ContextParallelOptions",
    "_cp_options",
    "_RotateMethod",
    "context_parallel",
    "context_parallel_unshard",
    "set_rotate_method",
    "_HeadTailLoadBalancer",
    "_LoadBalancer",
]
