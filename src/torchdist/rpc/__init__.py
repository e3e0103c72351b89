"""``torchdist.rpc``: remote procedure calls and remote references (``torch.distributed.rpc``'s API).

Re-exports only. The layers, top down: :mod:`.api` (what users call) ->
:mod:`.dispatch` (what a message means) and :mod:`.rref` / :mod:`.rref_context`
(remote references and their counting) -> :mod:`.agent` (requests over TCP) ->
:mod:`.wire` / :mod:`.serialization` / :mod:`.handshake` (bytes, pickles, auth).

Security: RPC runs functions named by its peers. Connections are authenticated
with the job secret (``TORCHDIST_SECRET``) when one is set; without it, anyone who
can reach a worker's address can run code in it.
"""

from . import backend_registry, functions
from .api import (_set_rpc_timeout, get_rpc_timeout, get_worker_info, init_rpc, is_available, is_initialized, remote,
                  rpc_async, rpc_sync, shutdown)
from .backend_registry import (BackendType, BackendValue, backend_registered, construct_rpc_backend_options,
                               init_backend, register_backend)
from .options import RpcBackendOptions, TensorPipeRpcBackendOptions, WorkerInfo
from .rref import RRef

__all__ = [
    "init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info", "get_rpc_timeout",
    "is_available", "is_initialized", "RRef", "WorkerInfo", "BackendType", "RpcBackendOptions",
    "TensorPipeRpcBackendOptions", "functions", "backend_registry", "backend_registered", "register_backend",
    "construct_rpc_backend_options", "init_backend", "BackendValue",
]
