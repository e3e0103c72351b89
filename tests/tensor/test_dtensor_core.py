"""DTensor's core against torch.distributed.tensor on gloo: layouts, redistribution, pointwise ops, autograd, optim.

Each body runs at world 1, 2, 3 (uneven shards: 5 rows over 3 or 4 ranks) and 4 as a 2x2 mesh, once under
torch and once under torchdist; every observation (global shape, placements, local block, errors) must agree.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from ._common import MESHES, Lib, compare, observe


def _layouts(lib: Lib):
    S, R = lib.S, lib.R
    if lib.ndim == 1:
        return [[S(0)], [S(1)], [R()]]
    return [[S(0), S(1)], [S(0), S(0)], [R(), S(1)], [S(1), R()], [S(1), S(0)]]


def _core(rank: int, world: int, lib_name: str, shape: tuple[int, ...]) -> dict:
    lib = Lib(lib_name, shape)
    T, S, R, P, mesh, nd = lib.T, lib.S, lib.R, lib.P, lib.mesh, lib.ndim
    out: dict = {}
    torch.manual_seed(0)
    full = torch.randn(5, 7)
    layouts = _layouts(lib)
    row = T.distribute_tensor(full[0], mesh, [R()] * nd)
    for i, pl in enumerate(layouts):
        x = T.distribute_tensor(full, mesh, pl)
        out[f"distribute {pl}"] = observe(lambda: x)
        out[f"full_tensor {pl}"] = observe(lambda: x.full_tensor())
        for pl2 in layouts:
            out[f"redistribute {pl} -> {pl2}"] = observe(lambda: x.redistribute(mesh, pl2))
        out[f"add scalar {pl}"] = observe(lambda: x + 1)
        out[f"mul self {pl}"] = observe(lambda: x * x)
        out[f"sin {pl}"] = observe(lambda: torch.sin(x))
        out[f"broadcast {pl}"] = observe(lambda: x + row)
        out[f"where {pl}"] = observe(lambda: torch.where(x > 0, x, row))
        z = x.clone()
        z.add_(x, alpha=2)
        out[f"add_ {pl}"] = observe(lambda: z)
        out[f"equal {pl}"] = observe(lambda: (torch.equal(x, z), torch.equal(x, x.clone())))
        out[f"clamp {pl}"] = observe(lambda: x.clamp(-0.5, 0.5))
        out[f"lerp_ {pl}"] = observe(lambda: x.clone().lerp_(torch.ones_like(x), 0.3))
        out[f"addcdiv_ {pl}"] = observe(lambda: x.clone().addcdiv_(x, torch.ones_like(x) * 2, value=0.5))
        out[f"addcmul_ {pl}"] = observe(lambda: x.clone().addcmul_(x, x, value=-0.5))
        out[f"fill_ {pl}"] = observe(lambda: x.clone().fill_(3))
        out[f"to float64 {pl}"] = observe(lambda: x.to(torch.float64))
        out[f"empty_like shape {pl}"] = observe(lambda: (torch.empty_like(x).shape, torch.empty_like(x).placements))
        out[f"mixed {pl}"] = observe(lambda: x + torch.ones(5, 7))
        out[f"0-d plain {pl}"] = observe(lambda: x * torch.tensor(2.0))
        if world > 1:
            other = layouts[(i + 1) % len(layouts)]
            y = T.distribute_tensor(full * 2, mesh, other)
            # On a 2-d mesh the layout picked for disagreeing inputs may differ from PyTorch's: compare values.
            diff = (lambda: x - y) if nd == 1 else (lambda: (x - y).full_tensor())
            out[f"mismatched placements {pl} {other}"] = observe(diff)
            out[f"copy_ {pl} <- {other}"] = observe(lambda: x.clone().copy_(y))
    # Partial: made with from_local, reduced by redistribution, kept by linear ops.
    p = T.DTensor.from_local(torch.arange(6.0).reshape(3, 2) * (rank + 1), mesh, [P()] * nd)
    out["partial full"] = observe(lambda: p.full_tensor())
    out["partial -> shard"] = observe(lambda: p.redistribute(mesh, [S(0)] * nd))
    out["partial -> shard(1)"] = observe(lambda: p.redistribute(mesh, [S(1)] + [R()] * (nd - 1)))
    out["partial * 2"] = observe(lambda: p * 2)
    out["partial / 2"] = observe(lambda: p / 2)
    out["partial + partial"] = observe(lambda: p + p)
    out["-partial"] = observe(lambda: -p)
    out["sin partial"] = observe(lambda: torch.sin(p))
    out["ones_like partial"] = observe(lambda: torch.ones_like(p))
    out["zero_ partial"] = observe(lambda: p.clone().zero_())
    out["to partial"] = observe(lambda: p.redistribute(mesh, [P("max")] * nd))
    pmax = T.DTensor.from_local(torch.arange(6.0).reshape(3, 2) * (rank + 1), mesh, [P("max")] * nd)
    out["partial max full"] = observe(lambda: pmax.full_tensor())
    pavg = T.DTensor.from_local(torch.ones(2) * rank, mesh, [P("avg")] * nd)
    out["partial avg"] = observe(lambda: pavg.full_tensor())
    # from_local: shapes inferred from equal shards, or given.
    local = torch.arange(6.0).reshape(2, 3) + 10 * rank
    out["from_local shard"] = observe(lambda: T.DTensor.from_local(local, mesh, [S(1)] * nd))
    out["from_local shape"] = observe(
        lambda: T.DTensor.from_local(local, mesh, [S(0)] * nd, shape=torch.Size([2 * world, 3]), stride=(3, 1)))
    out["from_local check"] = observe(lambda: T.DTensor.from_local(local, mesh, [R()] * nd, run_check=True))
    out["from_local negative dim"] = observe(lambda: T.DTensor.from_local(local, mesh, [S(-1)] * nd).placements)
    out["redistribute None"] = observe(lambda: row.redistribute(mesh, None))
    out["bad placements"] = observe(lambda: T.distribute_tensor(full, mesh, [S(0)] * (nd + 1)), message=False)
    out["is_same_size"] = observe(lambda: row.is_same_size(row.clone()))
    out["item"] = observe(lambda: T.distribute_tensor(full[:1, :1], mesh, [R()] * nd).sum().item())
    # Factories, random, src_data_rank.
    out["zeros"] = observe(lambda: T.zeros(5, 3, device_mesh=mesh, placements=[S(0)] * nd))
    out["ones"] = observe(lambda: T.ones((5, 3), device_mesh=mesh, placements=[S(1)] * nd, dtype=torch.float64))
    out["full"] = observe(lambda: T.full((5, 3), 2.5, device_mesh=mesh, placements=[R()] * nd))
    out["empty"] = observe(lambda: (T.empty(5, 3, device_mesh=mesh).shape, T.empty(4, device_mesh=mesh).placements))
    torch.manual_seed(3)
    out["rand_like"] = observe(lambda: torch.rand_like(T.distribute_tensor(full, mesh, [S(0)] * nd)))
    torch.manual_seed(4)
    mine = torch.randn(4, 6) + rank  # differs per rank: the layout must take rank 0's (or rank 1's) data
    out["src_data_rank 0"] = observe(lambda: T.distribute_tensor(mine, mesh, [S(1)] + [R()] * (nd - 1)))
    out["src_data_rank last"] = observe(
        lambda: T.distribute_tensor(mine, mesh, [R()] * (nd - 1) + [S(0)], src_data_rank=min(world - 1, 1)))
    torch.manual_seed(4)
    mine = torch.randn(4, 6) + rank  # afresh: PyTorch broadcasts into the caller's tensor above
    out["src_data_rank None"] = observe(lambda: T.distribute_tensor(mine, mesh, [S(0)] * nd, src_data_rank=None))
    out["repr"] = repr(T.distribute_tensor(full[:2, :2], mesh, [R()] * nd))
    lib.close()
    return out


@pytest.mark.parametrize("world,shape", MESHES)
def test_layouts_redistribution_and_pointwise_match_torch(world, shape):
    compare(_core, world, shape)


def _autograd(rank: int, world: int, lib_name: str, shape: tuple[int, ...]) -> dict:
    lib = Lib(lib_name, shape)
    T, S, R, P, mesh, nd = lib.T, lib.S, lib.R, lib.P, lib.mesh, lib.ndim
    out: dict = {}
    torch.manual_seed(0)
    g = torch.randn(5, 4)
    x = T.distribute_tensor(g, mesh, [S(0)] + [R()] * (nd - 1))
    x.requires_grad_(True)
    y = x.redistribute(mesh, [S(1)] + [S(0)] * (nd - 1))
    (y * y).full_tensor().sum().backward()
    out["grad through redistribute"] = observe(lambda: x.grad)
    out["leaf"] = (x.is_leaf, type(x.grad).__name__, y.requires_grad, y.is_leaf)
    loc = torch.ones(2, 3, requires_grad=True)
    (T.DTensor.from_local(loc * (rank + 1), mesh, [S(0)] * nd).to_local() * 3).sum().backward()
    out["from_local/to_local grad"] = observe(lambda: loc.grad)
    loc2 = torch.ones(2, 3, requires_grad=True)
    T.DTensor.from_local(loc2, mesh, [P()] * nd).full_tensor().sum().backward()
    out["partial from_local grad"] = observe(lambda: loc2.grad)
    loc3 = torch.ones(2, 3, requires_grad=True)
    (T.DTensor.from_local(loc3, mesh, [R()] * nd).redistribute(mesh, [S(1)] * nd).to_local() ** 2).sum().backward()
    out["replicate->shard grad"] = observe(lambda: loc3.grad)
    loc4 = torch.ones(2, 3, requires_grad=True)
    d4 = T.DTensor.from_local(loc4 * (rank + 1), mesh, [S(0)] * nd)
    d4.full_tensor(grad_placements=[P()] * nd).sum().backward()
    out["full_tensor grad_placements"] = observe(lambda: loc4.grad)
    loc5 = torch.ones(3, requires_grad=True)
    d5 = T.DTensor.from_local(loc5, mesh, [R()] * nd)
    (d5.to_local(grad_placements=[P()] * nd) * (rank + 1)).sum().backward()
    out["to_local grad_placements"] = observe(lambda: loc5.grad)
    # nn.Parameter keeps the DTensor type; .grad is a DTensor; optimizers step on both paths.
    for foreach in (False, True):
        for name in ("AdamW", "SGD", "Adam"):
            torch.manual_seed(1)
            w = torch.randn(6, 3)
            p1 = torch.nn.Parameter(T.distribute_tensor(w, mesh, [S(0)] + [R()] * (nd - 1)))
            p2 = torch.nn.Parameter(T.distribute_tensor(w[0] + 1, mesh, [S(0)] + [R()] * (nd - 1)))
            kwargs = {"lr": 0.1, "foreach": foreach, **({"momentum": 0.9} if name == "SGD" else {})}
            if name == "AdamW":
                kwargs["weight_decay"] = 0.1
            opt = getattr(torch.optim, name)([p1, p2], **kwargs)
            for _ in range(3):
                opt.zero_grad()
                (((p1 * 2).sin() * (p1 + 1) + p1 * p1).full_tensor().sum() + (p2 * p2).full_tensor().sum()).backward()
                opt.step()
            out[f"{name} foreach={foreach}"] = observe(lambda: (p1, p2, p1.grad))
            out[f"{name} state"] = observe(lambda: sorted(opt.state[p1].keys()))
    acc = torch.nn.Parameter(T.distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [S(0)] + [R()] * (nd - 1)))
    for scale in (1.0, 3.0):  # gradients accumulate into .grad across backward passes
        (acc * acc * scale).sum().full_tensor().backward()
    out["accumulated grad"] = observe(lambda: acc.grad)
    out["parameter"] = (type(p1).__name__, isinstance(p1, torch.nn.Parameter), p1.requires_grad, repr(p1)[:60])
    out["pickle"] = observe(lambda: pickle.loads(pickle.dumps(p1.detach())))
    out["deepcopy parameter"] = observe(
        lambda: (lambda q: (q, isinstance(q, torch.nn.Parameter), q is p1))(copy.deepcopy(p1)))
    lib.close()
    return out


@pytest.mark.parametrize("world,shape", MESHES)
def test_autograd_parameters_and_optimizers_match_torch(world, shape):
    compare(_autograd, world, shape)
