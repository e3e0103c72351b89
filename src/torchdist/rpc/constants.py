"""``torchdist.rpc.constants``: the defaults of ``torch.distributed.rpc.constants``."""

from __future__ import annotations

__all__ = ["DEFAULT_RPC_TIMEOUT_SEC", "DEFAULT_NUM_WORKER_THREADS", "DEFAULT_INIT_METHOD", "DEFAULT_SHUTDOWN_TIMEOUT",
           "UNSET_RPC_TIMEOUT"]

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_NUM_WORKER_THREADS = 16
DEFAULT_INIT_METHOD = "env://"
#: ``shutdown``'s ``timeout``: 0, the graceful wait for outstanding work has no limit
DEFAULT_SHUTDOWN_TIMEOUT = 0.0
#: ``timeout`` arguments at or below zero mean "the agent's default".
UNSET_RPC_TIMEOUT = -1.0
