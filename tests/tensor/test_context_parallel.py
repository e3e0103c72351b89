"""``context_parallel`` (tensor.experimental): ring attention on CPU against full-sequence attention in one process.

PyTorch 2.13's own ``context_parallel`` cannot run on CPU (its SDPA has no sharding strategy there), so the
reference is plain ``torch.nn.functional.scaled_dot_product_attention`` over the whole sequence, computed by
every rank before it enters the context. One spawn per world size (1 to 4) runs the whole matrix: causal and not,
both rotate methods, load balancing on and off (and its silent fallback), an explicit scale; outputs and the
gradients of q, k and v are unsharded and compared. The 2- and 3-rank spawns also train a tiny attention model
under context parallelism against the same run without it, and check buffers, restoring and errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchdist.testing import run_ranks

ATOL = 2e-5


def _setup(world: int):
    from torchdist.device_mesh import init_device_mesh
    from torchdist.tensor.experimental import _attention as A

    return init_device_mesh("cpu", (world,)), A


def _error(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        return type(exc).__name__, str(exc)
    return "no error", ""


def _check_attention(mesh, A, world: int, *, seq: int, causal: bool, rotate: str, balance: bool,
                     scale: float | None) -> dict:
    """Max differences of the unsharded output and q/k/v gradients from full-sequence SDPA, and the shard shape."""
    A.set_rotate_method(rotate)
    A._cp_options.enable_load_balance = balance
    torch.manual_seed(seq)
    q, k = torch.randn(2, 3, seq, 4), torch.randn(2, 3, seq, 4)
    v, grad = torch.randn(2, 3, seq, 5), torch.randn(2, 3, seq, 5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
    ref.backward(grad)
    buffers = [t.clone() for t in (q, k, v, grad)]
    with A.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4):
        local_shape = tuple(buffers[0].shape)
        local = [b.clone().requires_grad_() for b in buffers[:3]]
        out = F.scaled_dot_product_attention(*local, is_causal=causal, scale=scale)
        out.backward(buffers[3])
        got = A.context_parallel_unshard(mesh, [out, *(t.grad for t in local)], [2] * 4)
    want = [ref, *(t.grad for t in leaves)]
    diffs = {name: (g - w).abs().max().item() for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    diffs["restored"] = all(torch.equal(b, t) for b, t in zip(buffers, (q, k, v, grad)))
    diffs["shape"] = local_shape
    return diffs


def _count_calls(counts: dict) -> None:
    """Count, in the ring module, the attention score elements computed and the communication calls made."""
    import torchdist.tensor.experimental._context_parallel._ring as R

    def counting(name, fn, size=None):
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + (size(*args) if size else 1)
            return fn(*args, **kwargs)
        return wrapper

    R._attend = counting("scores", R._attend, lambda q, k, *rest: q.size(-2) * k.size(-2))
    for name in ("batch_isend_irecv", "all_gather_single", "reduce_scatter_single"):
        setattr(R, name, counting(name, getattr(R, name)))


def _matrix(rank: int, world: int) -> dict:
    mesh, A = _setup(world)
    out = {}
    counts: dict = {}
    _count_calls(counts)
    seq = 24  # divisible by 2 x world for world 1 to 4: load balanced when enabled
    for rotate in ("allgather", "alltoall"):
        for balance in (True, False):
            for causal in (True, False):
                scale = 0.37 if balance != causal else None
                counts.clear()
                out[rotate, balance, causal] = _check_attention(mesh, A, world, seq=seq, causal=causal,
                                                                rotate=rotate, balance=balance, scale=scale)
                out[rotate, balance, causal]["counts"] = dict(counts)
    # Load balancing enabled but 3 x world does not split into 2 x world chunks: plain sharding instead.
    for rotate in ("allgather", "alltoall"):
        out[rotate, "fallback"] = _check_attention(mesh, A, world, seq=3 * world, causal=True, rotate=rotate,
                                                   balance=True, scale=None)
    A._cp_options.enable_load_balance = True
    A.set_rotate_method("allgather")
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_full_attention(world):
    results = run_ranks(_matrix, world, timeout=90)
    for rank, observed in enumerate(results):
        for config, diffs in observed.items():
            where = f"world {world} rank {rank} {config}"
            for name in ("out", "dq", "dk", "dv"):
                assert diffs[name] < ATOL, f"{where}: {name} differs by {diffs[name]}"
            assert diffs["restored"], where
            expected_len = 3 if config[1] == "fallback" else 24 // world
            assert diffs["shape"] == (2, 3, expected_len, 4), where
            if config[1] == "fallback":
                continue
            # The schedule: allgather gathers K|V once (backward: one reduce-scatter); alltoall exchanges with
            # the neighbours W - 1 times forward, W - 1 (K/V) + W (dK/dV) times backward.
            rotate, balance, causal = config
            comm = {k: v for k, v in diffs["counts"].items() if k != "scores"}
            if world == 1:
                assert comm == {}, where
            elif rotate == "allgather":
                assert comm == {"all_gather_single": 1, "reduce_scatter_single": 1}, where
            else:
                assert comm == {"batch_isend_irecv": 3 * world - 2}, where
            # The work: score elements computed in the forward. Masked blocks are skipped: without balancing,
            # rank r sees r + 1 blocks; with it, every rank the same (3 + 2 (W - 1)) chunk-squares.
            block = 24 // world
            scores = diffs["counts"]["scores"]
            if not causal:
                assert scores == block * 24, where
            elif balance:
                assert scores == (3 + 2 * (world - 1)) * (block // 2) ** 2, where
            else:
                assert scores == (rank + 1) * block ** 2, where


# -- a training run ---------------------------------------------------------------------------------------------


class _TinyAttention(nn.Module):
    def __init__(self, embed: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(embed, 3 * embed)
        self.proj = nn.Linear(embed, embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, e = x.shape
        q, k, v = (t.view(b, s, self.heads, e // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # looked up at call time: CP's inside
        return self.proj(y.transpose(1, 2).reshape(b, s, e))


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, average) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(average(loss.detach()).item())
        for p in model.parameters():
            p.grad = average(p.grad)
        opt.step()
    return losses


def _training(rank: int, world: int, rotate: str) -> dict:
    import torchdist

    mesh, A = _setup(world)
    A.set_rotate_method(rotate)
    group = mesh.get_group()

    def average(t: torch.Tensor) -> torch.Tensor:  # the mean over the sequence shards' means
        t = t.clone()
        torchdist.all_reduce(t, group=group)
        return t / world

    torch.manual_seed(0)
    model = _TinyAttention()
    x, y = torch.randn(2, 4 * world, 8), torch.randn(2, 4 * world, 8)
    cp_model = copy.deepcopy(model)
    want = _train(model, x, y, 3, lambda t: t)
    xb, yb = x.clone(), y.clone()
    with A.context_parallel(mesh, buffers=[xb, yb], buffer_seq_dims=[1, 1], no_restore_buffers={yb}):
        got = _train(cp_model, xb, yb, 3, average)
    params = max((a - b).abs().max().item() for a, b in zip(model.parameters(), cp_model.parameters()))
    return {"losses": (want, got), "params": params, "x restored": torch.equal(xb, x),
            "y kept sharded": tuple(yb.shape)}


@pytest.mark.parametrize("world,rotate", [(2, "alltoall"), (3, "allgather")])
def test_training_matches_single_process(world, rotate):
    for rank, got in enumerate(run_ranks(_training, world, args=(rotate,), timeout=90)):
        want_losses, cp_losses = got["losses"]
        assert cp_losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6), f"rank {rank}"
        assert got["params"] < 1e-5, f"rank {rank}"
        assert got["x restored"] and got["y kept sharded"] == (2, 4, 8)


# -- buffers, layout and errors ----------------------------------------------------------------------------------


def _buffers_and_errors(rank: int, world: int) -> dict:
    mesh, A = _setup(world)
    out = {}
    original_sdpa = F.scaled_dot_product_attention
    # Head-tail layout: rank r keeps chunks r and 2W-1-r of 2W; without balancing, chunk r of W.
    pos, kept = torch.arange(8.0), torch.arange(8.0)
    with A.context_parallel(mesh, buffers=[pos, kept], buffer_seq_dims=[0, 0], no_restore_buffers={kept}):
        out["balanced"] = pos.tolist()
        out["patched"] = F.scaled_dot_product_attention is not original_sdpa
    out["restored"], out["not restored"] = pos.tolist(), kept.tolist()
    out["unpatched"] = F.scaled_dot_product_attention is original_sdpa
    A._cp_options.enable_load_balance = False
    with A.context_parallel(mesh, buffers=[pos], buffer_seq_dims=[0]):
        out["plain"] = pos.tolist()
        out["balance flag inside"] = A._cp_options.enable_load_balance
    A._cp_options.enable_load_balance = True
    # The flag inside says whether the buffers were balanced; the user's value comes back on exit.
    with A.context_parallel(mesh, buffers=[torch.zeros(6)], buffer_seq_dims=[0]):
        out["fallback flag inside"] = A._cp_options.enable_load_balance
    out["flag after"] = A._cp_options.enable_load_balance

    q = torch.randn(1, 2, 8, 4)
    with A.context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):
        out["mask"] = _error(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4).bool()))
        out["dropout"] = _error(lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1))
        out["gqa"] = _error(lambda: F.scaled_dot_product_attention(q, q, q, enable_gqa=True))
        out["causal lengths"] = _error(lambda: F.scaled_dot_product_attention(q, q[:, :, :1], q[:, :, :1],
                                                                              is_causal=True))
    uneven = torch.randn(1, 2, 5, 4)
    with A.context_parallel(mesh, buffers=[uneven], buffer_seq_dims=[2]):
        out["uneven shape"] = tuple(uneven.shape)  # torch.chunk's rule, as PyTorch
        out["uneven"] = _error(lambda: F.scaled_dot_product_attention(uneven, uneven, uneven, is_causal=True))
    try:
        with A.context_parallel(mesh, buffers=[pos], buffer_seq_dims=[0]):
            raise KeyError("raised inside")
    except KeyError:
        pass
    out["unpatched after error"] = F.scaled_dot_product_attention is original_sdpa and pos.numel() == 8
    # No buffers (PyTorch: IndexError): the user shards; float64 stays float64.
    A._cp_options.enable_load_balance = False
    torch.manual_seed(1)
    q64 = torch.randn(2, 2, 4 * world, 3, dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(q64, q64, q64, is_causal=True)
    with A.context_parallel(mesh):
        mine = q64.chunk(world, dim=2)[rank]
        got = F.scaled_dot_product_attention(mine, mine, mine, is_causal=True)
        out["no buffers"] = (got.dtype, (A.context_parallel_unshard(mesh, [got], [2])[0] - ref).abs().max().item())
    A._cp_options.enable_load_balance = True
    shards = A._context_parallel_shard(mesh, {"a": torch.arange(8.0)}, {"a": 0},
                                       A._HeadTailLoadBalancer(8, world, "cpu"))
    out["shard api"] = (shards["a"].tolist(), A._cp_options.enable_load_balance)
    A._cp_options.enable_load_balance = True
    t = torch.zeros(4)
    out["lengths"] = _error(lambda: A.context_parallel(mesh, buffers=[t], buffer_seq_dims=[0, 1]).__enter__())
    out["subset"] = _error(lambda: A.context_parallel(mesh, buffers=[t], buffer_seq_dims=[0],
                                                      no_restore_buffers={torch.zeros(4)}).__enter__())
    if world == 4:
        from torchdist.device_mesh import init_device_mesh

        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        out["2-D mesh"] = _error(lambda: A.context_parallel(mesh2d, buffers=[t], buffer_seq_dims=[0]).__enter__())
        with A.context_parallel(mesh2d["cp"], buffers=[pos], buffer_seq_dims=[0]):
            out["submesh"] = pos.tolist()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_buffers_layout_and_errors(world):
    results = run_ranks(_buffers_and_errors, world, timeout=90)
    full = list(range(8))
    for rank, got in enumerate(results):
        c = 8 // (2 * world)
        head = full[rank * c:(rank + 1) * c]
        tail = full[(2 * world - 1 - rank) * c:(2 * world - rank) * c]
        assert got["balanced"] == [float(i) for i in head + tail]
        assert got["patched"] and got["unpatched"] and got["unpatched after error"]
        assert got["restored"] == [float(i) for i in full]
        assert got["not restored"] == got["balanced"] and got["shard api"] == (got["balanced"], True)
        assert got["plain"] == [float(i) for i in full[rank * 8 // world:(rank + 1) * 8 // world]]
        assert got["balance flag inside"] is False
        assert got["fallback flag inside"] is (6 % (2 * world) == 0) and got["flag after"] is True
        assert got["mask"] == ("NotImplementedError", "attn_bias is not supported yet")
        assert got["dropout"][0] == "NotImplementedError" and "dropout_p=0.1" in got["dropout"][1]
        assert got["gqa"][0] == "NotImplementedError"
        assert got["causal lengths"] == ("NotImplementedError",
                                         "is_causal requires the same query and context sequence lengths")
        expected = [len(c) for c in torch.arange(5).chunk(world)] + [0] * world
        assert got["uneven shape"] == (1, 2, expected[rank], 4)
        assert got["uneven"][0] == "NotImplementedError" and "not divisible" in got["uneven"][1]
        assert got["no buffers"][0] == torch.float64 and got["no buffers"][1] < 1e-12
        assert got["lengths"] == ("ValueError", "`seq_dims` must have the same number of elements as `buffers`.")
        assert got["subset"] == ("ValueError", "`no_restore_buffers` must be a subset of `buffers`.")
        if world == 4:
            assert got["2-D mesh"][0] == "ValueError" and "1-D mesh" in got["2-D mesh"][1]
            cp_rank = rank % 2
            assert got["submesh"] == [float(i) for i in (full[cp_rank * 2:cp_rank * 2 + 2]
                                                         + full[(3 - cp_rank) * 2:(4 - cp_rank) * 2])]


# -- no ranks needed ----------------------------------------------------------------------------------------------


def test_single_process_pieces():
    from torchdist.tensor.experimental import _attention as A

    with pytest.raises(NotImplementedError, match="does not support using ring for kv shards rotation"):
        A.set_rotate_method("ring")
    balancer = A._HeadTailLoadBalancer(8, 2, "cpu")
    assert balancer._generate_indices().tolist() == [[0, 1, 6, 7, 2, 3, 4, 5]]
    order = balancer._generate_indices()[0]
    assert order[balancer._generate_indices(restore=True)[0]].tolist() == list(range(8))
    with pytest.raises(ValueError, match="divisible"):
        A._HeadTailLoadBalancer(6, 2, "cpu")._generate_indices()


def test_exports_match_torch():
    import torch.distributed.tensor.experimental._attention as theirs

    import torchdist.tensor.experimental as experimental
    from torchdist.tensor.experimental import _attention as ours

    assert "context_parallel" in experimental.__all__
    missing = set(theirs.__all__) - set(ours.__all__)
    # Not provided: flex-attention pieces, the DTensor-dispatch switches, the module-wrapper style and the
    # per-step causal rule of torch's ring (``_ring._Layout.visibility`` decides per chunk instead).
    assert missing == {"_CausalBehavior", "_is_causal_behavior", "_ContextParallel",
                       "_disable_context_parallel_dispatcher",
                       "_enable_context_parallel_dispatcher", "_templated_ring_attention",
                       "_PerDocumentHeadTailLoadBalancer", "_PTRRLoadBalancer"}
