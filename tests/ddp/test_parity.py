"""DDP matches a single process trained on the concatenated batch (inventory 67-69, 73, 78, 79)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchdist as dist
from torchdist.nn.parallel import DistributedDataParallel as DDP
from torchdist.testing import RanksFailed, run_ranks

from ._common import LR, TOL, assert_close_states, build, full_batches, shard, state, train_reference


def _train(rank, world_size, name, steps, ddp_kwargs):
    model = build(name, seed=0 if rank == 0 else 100 + rank)  # construction must align the replicas
    ddp = DDP(model, **ddp_kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for x, y in full_batches(name, world_size, steps):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    return state(ddp), ddp._get_ddp_logging_data()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
def test_ddp_matches_single_process(world_size, name, view):
    # A tiny bucket cap gives several buckets, so ordering and overlap are exercised.
    results = run_ranks(_train, world_size, args=(name, 4, {"gradient_as_bucket_view": view, "bucket_cap_mb": 0.002}),
                        backend="gloo")
    want = train_reference(name, world_size, 4)
    for rank, (got, log) in enumerate(results):
        assert_close_states(got, want)
        assert log["num_buckets"] > 1, log
        for k in got:
            assert torch.equal(got[k], results[0][0][k]), f"rank {rank} differs from rank 0 in {k}"


def _train_with_spare_cores(rank, world_size, name, ddp_kwargs):
    """A host faked to have four CPUs per rank: the shm backend overlaps async ops with
    compute there, so DDP issues its buckets with async_op=True and they run on the
    engine's worker while backward goes on."""
    import threading

    os.sched_getaffinity = lambda pid: set(range(4 * world_size))
    dist.init_process_group("gloo")
    try:
        overlaps = dist.group.WORLD.backend.async_overlaps_compute
        result = _train(rank, world_size, name, 4, ddp_kwargs)
        workers = [t.name for t in threading.enumerate() if t.name.startswith("torchdist-")]
        return result, overlaps, workers
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("find_unused", [False, True], ids=["all-used", "find-unused"])
def test_buckets_reduced_on_the_worker_on_hosts_with_spare_cores_match_single_process(find_unused):
    kwargs = {"bucket_cap_mb": 0.3, "find_unused_parameters": find_unused}
    results = run_ranks(_train_with_spare_cores, 2, args=("wide", kwargs), timeout=90)
    want = train_reference("wide", 2, 4)
    for (got, _), overlaps, workers in results:
        assert overlaps and workers, (overlaps, workers)  # 256 KiB buckets went to the worker
        assert_close_states(got, want)
        for k in got:
            assert torch.equal(got[k], results[0][0][0][k])


def _rebuild(rank, world_size):
    class Reordered(nn.Module):  # defined a, b, c but used c -> a -> b: arrival order is b, a, c
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

        def forward(self, x):
            return self.b(self.a(self.c(x)))

    torch.manual_seed(0)
    ddp = DDP(Reordered(), bucket_cap_mb=0.0001)
    before = ddp.reducer.bucket_indices()
    for _ in range(2):
        ddp(torch.randn(3, 6)).sum().backward()
    return before, ddp.reducer.bucket_indices(), ddp._get_ddp_logging_data()["has_rebuilt_buckets"]


def test_buckets_rebuilt_in_arrival_order():
    before, after, rebuilt = run_ranks(_rebuild, 2, backend="gloo")[0]
    # parameters: a.weight 0, a.bias 1, b.weight 2, b.bias 3, c.weight 4, c.bias 5. The weights
    # (144 bytes) fill the 104-byte limit on their own: solo buckets, closed at once, in reverse
    # order; the biases (24 bytes) share the coalesced bucket left open, reduced last.
    assert before == [[4], [2], [0], [5, 3, 1]], f"initial buckets must walk the parameters backwards: {before}"
    assert rebuilt
    arrival = [i for bucket in after for i in bucket]
    assert arrival.index(2) < arrival.index(0) < arrival.index(4), f"rebuilt buckets {after} not in arrival order"


def _mismatch(rank, world_size):
    model = nn.Linear(4, 4 + rank)
    try:
        DDP(model)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_shape_mismatch_raises_at_construction():
    for msg in run_ranks(_mismatch, 2, backend="gloo"):
        assert msg is not None and "appears not to match" in msg, msg


def _discard_then_train(rank, world_size):
    model = build("mlp")
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    batches = full_batches("mlp", world_size, 2)
    ddp(shard(batches[0][0], rank))  # output dropped, no backward
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    return state(ddp)


def test_forward_without_backward_is_harmless():
    got = run_ranks(_discard_then_train, 2, backend="gloo")
    assert_close_states(got[0], train_reference("mlp", 2, 2))


def _no_sync(rank, world_size, view, cap):
    ddp = DDP(build("mlp"), gradient_as_bucket_view=view, bucket_cap_mb=cap)
    x, y = full_batches("mlp", world_size, 1)[0]
    with ddp.no_sync():  # first micro-batch: local accumulation only
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
    local = [p.grad.clone() for p in ddp.parameters()]
    F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()  # second: reduces the sum
    return local, [p.grad.clone() for p in ddp.parameters()]


@pytest.mark.parametrize("cap", [None, 0.002], ids=["coalesced", "solo"])  # 0.002: net2.weight is solo
@pytest.mark.parametrize("view", [False, True])
def test_no_sync_accumulates_then_reduces(view, cap):
    results = run_ranks(_no_sync, 2, args=(view, cap), backend="gloo")
    model = build("mlp")
    x, y = full_batches("mlp", 2, 1)[0]
    for rank in range(2):  # reference: each rank's local grad, and 2x the full-batch average
        F.cross_entropy(model(shard(x, rank)), shard(y, rank)).backward()
        want_local = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        for got, want in zip(results[rank][0], want_local):
            torch.testing.assert_close(got, want, **TOL)
    F.cross_entropy(model(x), y).backward()
    for rank in range(2):
        for got, p in zip(results[rank][1], model.parameters()):
            torch.testing.assert_close(got, 2 * p.grad, **TOL)


def _buffers(rank, world_size):
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ddp = DDP(model)
    ddp(torch.randn(8, 4) + rank).sum().backward()  # running stats now differ per rank
    before = model[1].running_mean.clone()
    ddp.eval()
    with torch.no_grad():
        ddp(torch.randn(8, 4))  # the forward broadcasts rank 0's buffers (eval: no update after)
    assert rank == 0 or not torch.equal(before, model[1].running_mean), "buffers differed before the broadcast"
    return model[1].running_mean.clone(), model[1].running_var.clone(), state(ddp)


def test_buffers_broadcast_from_rank0_each_forward():
    r0, r1 = run_ranks(_buffers, 2, backend="gloo")
    assert torch.equal(r0[2]["module.1.running_mean"], r1[2]["module.1.running_mean"])
    assert torch.equal(r0[2]["module.1.running_var"], r1[2]["module.1.running_var"])


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("persistent", torch.zeros(2))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x):
        return self.lin(x)


def _construction(rank, world_size, kwargs, join):
    torch.manual_seed(rank)  # every rank starts with its own parameters and buffers
    model = _WithBuffers()
    model.persistent.fill_(rank + 1)
    model.scratch.fill_(rank + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DDP(model, **kwargs)
    if join:  # rank 1 trains one step more; join's final sync must respect the buffer setting
        with ddp.join():
            for _ in range(1 + rank):
                ddp(torch.ones(1, 2)).sum().backward()
    return (model.lin.weight.detach().clone(), model.persistent.clone(), model.scratch.clone(),
            [w.category for w in caught])


@pytest.mark.parametrize("join", [False, True])
@pytest.mark.parametrize("kwargs, buffers_synced, warns", [
    ({}, True, False),
    ({"broadcast_buffers": False}, False, True),  # deprecated in 2.13, and skips buffers at construction
    ({"forward_sync_buffers": False}, True, False),  # buffers still synced at construction
])
def test_construction_and_join_sync_parameters_and_buffers_as_pytorch(kwargs, buffers_synced, warns, join):
    r0, r1 = run_ranks(_construction, 2, args=(kwargs, join), backend="gloo")
    assert torch.equal(r0[0], r1[0])  # parameters: always synced
    for i in (1, 2):  # persistent and non-persistent buffers (named_buffers, not state_dict)
        assert torch.equal(r0[i], r1[i]) == (buffers_synced or (join and "broadcast_buffers" not in kwargs)), i
    assert (FutureWarning in r0[3]) == warns


def test_falsy_device_ids_and_output_device_pass_on_cpu_as_in_pytorch():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        DDP(nn.Linear(2, 2), device_ids=[], output_device=0)
        with pytest.raises(ValueError, match="device_ids can only be None or contain a single element"):
            DDP(nn.Linear(2, 2), device_ids=[0, 1])
    finally:
        dist.destroy_process_group()


def _checkpoint(rank, world_size, path, resume):
    ddp = DDP(build("mlp"))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    batches = full_batches("mlp", world_size, 4)
    for i, (x, y) in enumerate(batches):
        if resume and i == 2:
            if rank == 0:
                torch.save({"model": ddp.state_dict(), "opt": opt.state_dict()}, path)
            dist.barrier()
            ddp = DDP(build("mlp", seed=rank + 7))
            opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
            ckpt = torch.load(path)
            ddp.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    return state(ddp)


def test_checkpoint_save_load_resumes_identically(tmp_path):
    path = os.fspath(tmp_path / "ckpt.pt")
    plain = run_ranks(_checkpoint, 2, args=(path, False), backend="gloo")
    resumed = run_ranks(_checkpoint, 2, args=(path, True), backend="gloo")
    assert all(k.startswith("module.") for k in torch.load(path)["model"])
    for a, b in zip(plain, resumed):
        for k in a:
            torch.testing.assert_close(a[k], b[k], **TOL)


def _autocast(rank, world_size):
    ddp = DDP(build("mlp"))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for x, y in full_batches("mlp", world_size, 3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(ddp(shard(x, rank)), shard(y, rank))
        loss.backward()
        opt.step()
    return state(ddp)


def test_autocast_matches_reference_within_bf16_tolerance():
    got = run_ranks(_autocast, 2, backend="gloo")
    assert_close_states(got[0], train_reference("mlp", 2, 3), rtol=2e-2, atol=2e-2)
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k])


def test_rejects_device_ids_for_cpu_module():
    with pytest.raises(ValueError, match="device_ids"):
        DDP(nn.Linear(2, 2), device_ids=[0])


def _compiled(rank, world_size, outer, options):
    model = build("mlp")
    ddp = (torch.compile(DDP(model, **options), backend="aot_eager") if outer
           else DDP(torch.compile(model, backend="aot_eager"), **options))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for x, y in full_batches("mlp", world_size, 3):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    return {k.replace("_orig_mod.", ""): v.detach() for k, v in ddp.state_dict().items()}


@pytest.mark.parametrize("options", [{}, {"find_unused_parameters": True}, {"static_graph": True}],
                         ids=["plain", "find_unused", "static_graph"])
@pytest.mark.parametrize("outer", [False, True], ids=["DDP(compile(m))", "compile(DDP(m))"])
def test_torch_compile_matches_single_process(outer, options):
    # compile(DDP(m, find_unused_parameters=True)) traced DDP's sink: its backward got
    # the reducer where it expected a weak reference and raised.
    got = run_ranks(_compiled, 2, args=(outer, options), backend="gloo", timeout=100)
    assert_close_states(got[0], train_reference("mlp", 2, 3))


class _SparseBag(nn.Module):
    """An embedding with sparse gradients (its own bucket) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def _sparse_batches(world_size, steps):
    g = torch.Generator().manual_seed(3)
    n = world_size * 2
    return [(torch.randint(0, 12, (n, 3), generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


def _train_sparse(model, batches, rank, world_size, ddp_kwargs=None, hook=None):
    """SparseAdam for the embedding (it needs sparse gradients), SGD for the head."""
    ddp = DDP(model, **ddp_kwargs) if ddp_kwargs is not None else model
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    sparse_opt = torch.optim.SparseAdam([model.emb.weight], lr=LR)
    dense_opt = torch.optim.SGD(model.head.parameters(), lr=LR)
    layouts = []
    for ids, y in batches:
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        rows = slice(2 * rank, 2 * rank + 2) if ddp_kwargs is not None else slice(None)
        F.cross_entropy(ddp(ids[rows]), y[rows]).backward()
        layouts.append(model.emb.weight.grad.layout)
        sparse_opt.step()
        dense_opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, layouts


def _sparse_rank(rank, world_size, hook_name, ddp_kwargs):
    from torchdist.algorithms.ddp_comm_hooks import default_hooks
    torch.manual_seed(0)
    hook = getattr(default_hooks, hook_name) if hook_name else None
    return _train_sparse(_SparseBag(), _sparse_batches(world_size, 3), rank, world_size, ddp_kwargs, hook)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook", [None, "allreduce_hook"])
@pytest.mark.parametrize("ddp_kwargs", [{}, {"find_unused_parameters": True, "bucket_cap_mb": 0.0001}],
                         ids=["default", "find-unused-small-buckets"])
def test_sparse_embedding_gradients_stay_sparse_and_match_single_process(world_size, hook, ddp_kwargs):
    torch.manual_seed(0)
    want, _ = _train_sparse(_SparseBag(), _sparse_batches(world_size, 3), 0, world_size)
    for got, layouts in run_ranks(_sparse_rank, world_size, args=(hook, ddp_kwargs), backend="gloo"):
        assert layouts == [torch.sparse_coo] * 3  # SparseAdam would have raised on a dense one
        assert_close_states(got, want, prefix="")
