"""Helpers shared by the RPC tests: start RPC on a rank of ``run_ranks`` and stop it."""

from __future__ import annotations

import torchdist.rpc as rpc


def start(rank: int, world_size: int, **options) -> None:
    """init_rpc as worker{rank} through env:// (MASTER_ADDR/PORT set by run_ranks)."""
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=options.pop("num_worker_threads", 8), **options)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)


def name(rank: int) -> str:
    return f"worker{rank}"
