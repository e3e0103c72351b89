"""Start ``world_size`` local processes that call ``fn(rank, world_size)``, like ``mp.spawn`` (for the examples).

On a cluster, launch with ``torchdist-run`` instead and call ``fn`` with RANK/WORLD_SIZE.
"""

import multiprocessing as mp
import os
import socket
import sys


def spawn(fn, world_size: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(rank, world_size)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    codes = [proc.exitcode for proc in procs]
    if any(code != 0 for code in codes):
        sys.exit(f"workers failed with exit codes {codes}")
