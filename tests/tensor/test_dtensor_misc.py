"""Placements against PyTorch's (no processes), and what torchdist adds or defines itself: the replicate-and-run
fallback for ops without a rule (warned once, correct values, in-place results written back), distribute_module,
the CPU random factories, and errors that name the operation."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.tensor as torch_tensor

import torchdist.tensor as T
from torchdist.tensor import Partial, Replicate, Shard
from torchdist.tensor._placements import shard_size_and_offset
from torchdist.testing import run_ranks


def test_placements_behave_like_torchs():
    pairs = [(Shard(0), torch_tensor.Shard(0)), (Shard(2), torch_tensor.Shard(2)),
             (Replicate(), torch_tensor.Replicate()),
             (Partial(), torch_tensor.Partial()), (Partial("max"), torch_tensor.Partial("max")),
             (Partial("avg"), torch_tensor.Partial("avg"))]
    for ours, theirs in pairs:
        assert (repr(ours), str(ours)) == (repr(theirs), str(theirs))
        assert (ours.is_shard(), ours.is_replicate(), ours.is_partial()) == \
            (theirs.is_shard(), theirs.is_replicate(), theirs.is_partial())
        assert ours.is_shard(0) == theirs.is_shard(0)
        assert pickle.loads(pickle.dumps(ours)) == ours
    assert Shard(1) == Shard(1) and hash(Shard(1)) == hash(Shard(1)) and Shard(1) != Shard(0)
    assert Partial() == Partial("sum") and Partial() != Partial("avg") and Replicate() != Shard(0)
    assert len({Shard(0), Shard(0), Replicate(), Replicate(), Partial()}) == 3
    with pytest.raises(ValueError):
        Partial("median")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_uneven_chunks_follow_torch_chunk(world):
    for size in range(10):
        expected = [c.size(0) for c in torch.arange(size).chunk(world)] if size else []
        expected += [0] * (world - len(expected))
        got = [shard_size_and_offset(size, world, r)[0] for r in range(world)]
        assert got == expected, (size, world)
        assert [shard_size_and_offset(size, world, r)[1] for r in range(world)] == \
            [min(size, sum(expected[:r])) for r in range(world)]
        pieces, pads = Shard(0)._split_tensor(torch.arange(size), world)
        full = -(-size // world)
        assert [p.numel() for p in pieces] == [full] * world and sum(pads) == world * full - size
        theirs, their_pads = torch_tensor.Shard(0)._split_tensor(torch.arange(size), world)
        assert pads == their_pads and all(torch.equal(a, b) for a, b in zip(pieces, theirs))
        unpadded, none = Shard(0)._split_tensor(torch.arange(size), world, with_padding=False)
        assert [p.numel() for p in unpadded] == expected and none == []


def _misc(rank: int, world: int) -> dict:
    import torchdist
    from torchdist.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    full = torch.arange(35.0).reshape(7, 5)
    x = T.distribute_tensor(full, mesh, [Shard(0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = torch.cumsum(x, 1)
        second = torch.cumsum(x, 0)
    out["fallback values"] = (torch.equal(first.full_tensor(), full.cumsum(1)),
                              torch.equal(second.full_tensor(), full.cumsum(0)), first.placements)
    out["fallback warnings"] = sum("no sharding rule" in str(w.message) for w in caught)
    y = x.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        returned = y.cumsum_(0)  # in place, no rule: computed whole, written back into the shards
    out["fallback in place"] = (torch.equal(y.full_tensor(), full.cumsum(0)), y.placements, returned is y)
    out["mixed error"] = _error(lambda: x + full)
    from torchdist.tensor.experimental import implicit_replication

    with implicit_replication():
        mixed = x + full
    out["implicit replication"] = (torch.equal(mixed.full_tensor(), full * 2), mixed.placements)
    out["bad redistribute"] = _error(lambda: x.redistribute(mesh, [Partial()]))
    out["bad placements"] = _error(lambda: T.distribute_tensor(full, mesh, [Shard(0), Shard(1)]))
    out["bad dim"] = _error(lambda: T.distribute_tensor(full, mesh, [Shard(2)]))
    # distribute_module: a partition function shards the weight, hooks convert inputs and outputs.
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 4)
    reference = lin(full)

    def partition(name, module, device_mesh):
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(T.distribute_tensor(module.weight, device_mesh, [Shard(0)]))

    T.distribute_module(lin, mesh, partition, input_fn=lambda mod, inputs, m: tuple(
        T.distribute_tensor(i, m, [Replicate()]) for i in inputs), output_fn=lambda mod, o, m: o.full_tensor())
    out["module params"] = [(n, type(p).__name__, p.placements) for n, p in lin.named_parameters()]
    out["module forward"] = torch.allclose(lin(full), reference, atol=1e-6)
    out["module twice"] = _error(lambda: T.distribute_module(lin, mesh))
    # CPU random factories: each rank draws its own block (PyTorch 2.13 fails here with a bare AssertionError).
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = T.rand(7, 3, device_mesh=mesh, placements=[Shard(0)])
    torch.manual_seed(5)
    out["rand block"] = torch.equal(r.to_local(), torch.rand(r.to_local().shape))
    out["rand warning"] = any("random operators" in str(w.message) for w in caught)
    out["randn shape"] = (T.randn(4, 6, device_mesh=mesh, placements=[Shard(1)]).shape, r.shape)
    with mesh:
        out["current mesh"] = T.ones(3, 3).placements
    # Attention with heads split (PyTorch 2.13 has no DTensor rule for the CPU kernel): against plain tensors.
    torch.manual_seed(6)
    q_full = torch.randn(2, 3, 5, 4, requires_grad=True)
    q = T.distribute_tensor(q_full.detach(), mesh, [Shard(1)]).requires_grad_(True)
    attn = torch.nn.functional.scaled_dot_product_attention(q, q * 0.5, q + 1.0, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q_full, q_full * 0.5, q_full + 1.0, is_causal=True)
    attn.sum().backward()
    expected.sum().backward()
    out["attention"] = (attn.placements, torch.allclose(attn.full_tensor(), expected, atol=1e-6),
                        q.grad.placements, torch.allclose(q.grad.full_tensor(), q_full.grad, atol=1e-6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["pointwise sweep"] = _pointwise_sweep(mesh)
    out["sweep fallbacks"] = sorted({str(w.message).split()[1] for w in caught if "no sharding rule" in str(w.message)})
    torchdist.barrier()
    return out


_UNARY = ["abs", "exp", "log1p", "sigmoid", "tanh", "relu", "sin", "cos", "sign", "floor", "ceil", "round", "erf",
          "neg", "reciprocal", "rsqrt", "sqrt", "square", "expm1", "trunc", "frac", "logical_not", "isnan", "isfinite",
          "nan_to_num", "sgn", "angle", "exp2", "log_softmax"]
_BINARY = ["add", "sub", "mul", "div", "maximum", "minimum", "atan2", "fmod", "remainder", "eq", "ne", "lt", "ge",
           "logical_and", "hypot", "copysign", "pow", "xlogy", "floor_divide", "true_divide"]


def _pointwise_sweep(mesh) -> list:
    """Every listed unary and binary op (with broadcasting and a Python scalar) on shards of two layouts, against
    the same op on whole tensors; autograd through a few. Returns what disagreed."""
    torch.manual_seed(7)
    a, b = torch.rand(7, 5) + 0.5, torch.rand(7, 5) + 0.5
    row = torch.rand(5) + 0.5
    bad = []
    for placement in (Shard(0), Shard(1)):
        x, y = T.distribute_tensor(a, mesh, [placement]), T.distribute_tensor(b, mesh, [placement])
        r = T.distribute_tensor(row, mesh, [Replicate()])
        for name in _UNARY:
            fn = (lambda t: t.log_softmax(-1)) if name == "log_softmax" else getattr(torch, name)
            got, want = fn(x), fn(a)
            if not torch.allclose(got.full_tensor().float(), want.float(), equal_nan=True):
                bad.append((name, placement))
        for name in _BINARY:
            fn = getattr(torch, name)
            scalar_ok = name not in ("maximum", "minimum", "atan2", "hypot", "logical_and", "xlogy", "copysign")
            for other, whole in ((y, b), (r, row)) + (((2.0, 2.0),) if scalar_ok else ()):
                got, want = fn(x, other), fn(a, whole)
                if not torch.allclose(got.full_tensor().float(), want.float(), equal_nan=True):
                    bad.append((name, placement, type(other).__name__))
                if got.placements != (placement,):
                    bad.append((name, placement, "placement", got.placements))
        for name in ("gelu", "silu", "softplus", "elu", "leaky_relu", "hardtanh", "mish"):
            fn = getattr(torch.nn.functional, name)
            leaf, whole = x.detach().requires_grad_(True), a.clone().requires_grad_(True)
            (fn(leaf) * leaf).sum().backward()
            (fn(whole) * whole).sum().backward()
            if not torch.allclose(leaf.grad.full_tensor(), whole.grad, atol=1e-6):
                bad.append((name, placement, "backward"))
    return bad


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        return type(exc).__name__, str(exc)
    return None


def test_fallback_distribute_module_factories_and_errors():
    for rank, out in enumerate(run_ranks(_misc, 3, timeout=60)):
        assert out["fallback values"] == (True, True, (Replicate(),))
        assert out["fallback warnings"] == 1  # once per op, not per call
        assert out["fallback in place"] == (True, (Shard(0),), True)
        assert out["mixed error"] == ("RuntimeError", "aten.add.Tensor got mixed torch.Tensor and DTensor, need to "
                                      "convert all torch.Tensor to DTensor before calling distributed operators!")
        assert out["implicit replication"] == (True, (Shard(0),))
        assert out["bad redistribute"][0] == "RuntimeError" and "Partial" in out["bad redistribute"][1]
        assert out["bad placements"][0] == "ValueError" and "distribute_tensor" in out["bad placements"][1]
        assert out["bad dim"][0] == "IndexError" and "Shard(2)" in out["bad dim"][1]
        assert out["module params"] == [("weight", "DTensor", (Shard(0),)), ("bias", "DTensor", (Replicate(),))]
        assert out["module forward"] is True
        assert out["module twice"][0] == "RuntimeError"
        assert out["rand block"] and out["rand warning"], rank
        assert out["randn shape"] == (torch.Size([4, 6]), torch.Size([7, 3]))
        assert out["current mesh"] == (Replicate(),)
        assert out["pointwise sweep"] == [] and out["sweep fallbacks"] == [], rank
        assert out["attention"] == ((Shard(1),), True, (Shard(1),), True)


def _distribute_without_communication_copies(rank: int, world_size: int) -> list[bool]:
    from torchdist.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    source = torch.arange(12.0).reshape(6, 2)
    dtensors = [T.distribute_tensor(source, mesh, [placement], src_data_rank=None)
                for placement in (Shard(0), Shard(1), Replicate())]
    expected = [d.to_local().clone() for d in dtensors]
    source.add_(100)  # the caller's tensor changes later; no rank's DTensor may see it
    return [torch.equal(d.to_local(), e) for d, e in zip(dtensors, expected)]


def test_distribute_tensor_without_communication_owns_its_blocks_on_every_rank():
    results = run_ranks(_distribute_without_communication_copies, 3, backend="gloo", timeout=60)
    assert results == [[True, True, True]] * 3
