"""PyTorch's ``torch.distributed.tensor.experimental._attention`` path: re-exports ``_context_parallel``."""

from ._context_parallel import (_context_parallel_shard, _ContextParallelOptions, _cp_options,
                                _HeadTailLoadBalancer, _LoadBalancer, _RotateMethod,
                                context_parallel, context_parallel_unshard, set_rotate_method)

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
