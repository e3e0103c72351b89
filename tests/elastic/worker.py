"""The worker program the launcher tests start: ``worker.py MODE OUTDIR [ARG]``.

Every mode first writes ``OUTDIR/rank<RANK>.attempt<N>.<pid>.json``: the launcher
variables it sees and its pid, so that tests can check the environment and look
for orphans. Then:

``env``          exit 0
``fail-once``    rank 1 exits 3 on attempt 0; everyone succeeds on later attempts
``raise``        rank 1 raises ValueError under @record; the others sleep
``exit``         rank ARG exits 7 at once; the others sleep
``sleep``        sleep ARG seconds (a worker to kill or signal)
``barrier``      meet every rank in the launcher's store (authenticated) and exit 0
``pg``           init_process_group() with no arguments, all_reduce, barrier
``hosts``        init_process_group() with no arguments, then collectives whose results depend on every
                 rank (small and large all-reduce, all-gather, broadcast, reduce-scatter); record them and
                 the backend the default picked
``partition``    init_process_group(timeout=ARG seconds) and a barrier, write ``ready<RANK>``, wait for
                 ``OUTDIR/cut`` (the test cuts the link between the hosts), then all_reduce: record
                 what it raised and after how long
``rpc``          init_rpc(f"worker{RANK}"), then rpc_sync, remote and a distributed backward through the
                 next rank; record the results and whether the link to the peer stayed on TCP
``no-secret``    try the launcher's store without the secret; record what happened
``print``        print a line on stdout and one on stderr
``elastic``      barrier in the store, write ``joined<RANK>.world<N>``; in a world of 1 after the test
                 wrote ``OUTDIR/peer-killed``, write ``done`` and exit 0; else sleep (until restarted)
"""

from __future__ import annotations

import json
import os
import sys
import time

MODE, OUTDIR = sys.argv[1], sys.argv[2]
ARG = sys.argv[3] if len(sys.argv) > 3 else ""
NAMES = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
]
RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def write(name: str, data: dict) -> None:
    tmp = os.path.join(OUTDIR, name + ".tmp")
    with open(tmp, "w") as fp:
        json.dump(data, fp)
    os.replace(tmp, os.path.join(OUTDIR, name))


def agent_store(secret=None):
    from torchdist import TCPStore

    kwargs = {} if secret is None else {"secret": secret}
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, 20, **kwargs)


def store_barrier() -> None:
    store = agent_store()
    store.barrier("test/barrier", int(os.environ["WORLD_SIZE"]), timeout=20)
    store.close()


env = {name: os.environ.get(name) for name in NAMES}
env.update(pid=os.getpid(), has_secret=bool(os.environ.get("TORCHDIST_SECRET")), argv=sys.argv[1:])
write(f"rank{RANK}.attempt{ATTEMPT}.{os.getpid()}.json", env)

if MODE == "env":
    pass
elif MODE == "fail-once":
    if RANK == 1 and ATTEMPT == 0:
        sys.exit(3)
    if ARG == "barrier":  # the others wait for rank 1's next attempt (no node finishes early)
        store_barrier()
elif MODE == "raise":
    from torchdist.elastic.multiprocessing.errors import record

    @record
    def main() -> None:
        if RANK == 1:
            raise ValueError("boom from rank 1")
        time.sleep(60)

    main()
elif MODE == "raise-plain":  # no @record: under --run-path the launcher's runner records it
    if RANK == 1:
        raise ValueError("plain boom from rank 1")
    time.sleep(60)
elif MODE == "exit":
    if RANK == int(ARG):
        time.sleep(0.5)
        sys.exit(7)
    time.sleep(60)
elif MODE == "sleep":
    time.sleep(float(ARG or 60))
elif MODE == "barrier":
    store_barrier()
elif MODE == "pg":
    import torch

    import torchdist

    torchdist.init_process_group()
    t = torch.ones(1)
    torchdist.all_reduce(t)
    torchdist.barrier()
    write(f"pg{RANK}.json", {"sum": t.item(), "world": torchdist.get_world_size(), "rank": torchdist.get_rank()})
    store_barrier()  # nobody tears the group down while a peer may still be finishing its last collective
    torchdist.destroy_process_group()
elif MODE == "hosts":
    import torch

    import torchdist

    torchdist.init_process_group()
    world, rank = torchdist.get_world_size(), torchdist.get_rank()
    sums = []
    for numel in (2, (1 << 18) + 5):  # 8 B (one step) and 1 MiB (chunked) all-reduces
        t = torch.arange(numel, dtype=torch.float32) + rank
        torchdist.all_reduce(t)
        sums.append(t[-1].item())
    gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    torchdist.all_gather(gathered, torch.full((3,), rank * 10))
    root_value = torch.tensor([rank + 100])
    torchdist.broadcast(root_value, src=world - 1)
    scattered = torch.zeros(2)
    torchdist.reduce_scatter_tensor(scattered, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
    write(f"hosts{RANK}.json", {"sums": sums, "gathered": [g.tolist() for g in gathered],
                                "broadcast": root_value.item(), "scattered": scattered.tolist(),
                                "backend": type(torchdist.group.WORLD.backend).__name__})
    store_barrier()  # nobody tears the group down while a peer may still be finishing its last collective
    torchdist.destroy_process_group()
elif MODE == "partition":
    from datetime import timedelta

    import torch

    import torchdist

    torchdist.init_process_group(timeout=timedelta(seconds=float(ARG)))
    torchdist.barrier()
    write(f"ready{RANK}.json", {})
    while not os.path.exists(os.path.join(OUTDIR, "cut")):
        time.sleep(0.05)
    start = time.monotonic()
    try:
        torchdist.all_reduce(torch.ones(1 << 16))
        outcome = {"raised": None}
    except Exception as exc:  # noqa: BLE001 - the test inspects the type
        outcome = {"raised": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    write(f"partition{RANK}.json", outcome)
    os._exit(0)  # the group is broken and its peers unreachable: nothing to tear down
elif MODE == "rpc":
    import torch

    import torchdist.autograd as dist_autograd
    from torchdist import rpc

    world = int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{RANK}", rank=RANK, world_size=world)
    peer = f"worker{(RANK + 1) % world}"
    added = rpc.rpc_sync(peer, torch.add, args=(torch.ones(3), RANK))
    owned = rpc.remote(peer, torch.mul, args=(torch.arange(3.0), 2))
    w = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(peer, torch.mul, args=(w, 3.0)).sum()
        dist_autograd.backward(context_id, [loss])
        grad = dist_autograd.get_gradients(context_id)[w]
    # the peer's connection: a Unix socket would mean the same-host upgrade misjudged the hosts
    families = sorted({conn.sock.family.name for conn in rpc.api._get().agent._conns.values()})
    write(f"rpc{RANK}.json", {"added": added.tolist(), "owned": owned.to_here().tolist(), "grad": grad.tolist(),
                              "families": families})
    rpc.shutdown()
elif MODE == "no-secret":
    outcome = {}
    for label, secret in (("none", ""), ("wrong", "not-the-secret"), ("right", None)):
        try:
            store = agent_store(secret)
            store.add(f"probe/{label}", 1)
            outcome[label] = "ok" if store.get(f"probe/{label}") == b"1" else "bad"
            store.close()
        except Exception as exc:  # noqa: BLE001 - the test inspects the type
            outcome[label] = type(exc).__name__ + ": " + str(exc)
    write(f"auth{RANK}.json", outcome)
elif MODE == "print":
    print(f"hello from rank {RANK}", flush=True)
    print(f"complaint from rank {RANK}", file=sys.stderr, flush=True)
elif MODE == "elastic":
    store_barrier()
    world = int(os.environ["WORLD_SIZE"])
    write(f"joined{RANK}.world{world}.{os.getpid()}.json", {"world": world})
    if world == 1 and os.path.exists(os.path.join(OUTDIR, "peer-killed")):
        write(f"done{RANK}.{os.getpid()}.json", {"world": world})
    else:
        time.sleep(60)  # until the agent restarts this worker in a new round
else:
    sys.exit(f"unknown mode {MODE}")
