"""Sharding propagation of reductions, matrix products, views, softmax, embedding, losses and their backward.

Same program under torch.distributed.tensor (gloo) and torchdist.tensor at world 1-4 (and 2x2): same output
placements, shapes, local blocks and gradients. Shapes avoid empty shards where PyTorch itself misbehaves
(its amax over an empty shard hangs); uneven shards are covered with 7 rows over 3 and 4 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ._common import MESHES, Lib, compare, observe


def _ops(rank: int, world: int, lib_name: str, shape: tuple[int, ...]) -> dict:
    lib = Lib(lib_name, shape)
    T, S, R, mesh, nd = lib.T, lib.S, lib.R, lib.mesh, lib.ndim
    rest = [R()] * (nd - 1)
    out: dict = {}
    torch.manual_seed(0)
    a = torch.randn(8, 6)
    w = torch.randn(6, 4)
    for name, pl in (("S0", [S(0)] + rest), ("S1", [S(1)] + rest), ("R", [R()] * nd), ("S0S1", [S(0), S(1)][:nd])):
        x = T.distribute_tensor(a, mesh, pl)
        out[f"sum {name}"] = observe(lambda: x.sum())
        out[f"sum0 {name}"] = observe(lambda: x.sum(0))
        out[f"sum1 keepdim {name}"] = observe(lambda: x.sum(1, keepdim=True))
        out[f"mean {name}"] = observe(lambda: x.mean(0))
        out[f"amax {name}"] = observe(lambda: x.amax(1))
        out[f"max {name}"] = observe(lambda: x.max())
        out[f"amin full {name}"] = observe(lambda: x.amin(0).full_tensor())
        for wname, wpl in (("S0", [S(0)] + rest), ("S1", [S(1)] + rest), ("R", [R()] * nd)):
            y = T.distribute_tensor(w, mesh, wpl)
            # On a 2-d mesh PyTorch breaks cost ties between layouts differently: compare the values there.
            out[f"mm {name} {wname}"] = observe(lambda: torch.mm(x, y) if nd == 1 else torch.mm(x, y).full_tensor())
        out[f"t {name}"] = observe(lambda: x.t())
        out[f"transpose {name}"] = observe(lambda: x.transpose(0, 1))
        out[f"view {name}"] = observe(lambda: x.view(8, 2, 3))
        out[f"unsqueeze {name}"] = observe(lambda: x.unsqueeze(1))
        # Where PyTorch keeps a shard that a merge makes strided (_StridedShard), torchdist replicates: values only.
        out[f"reshape {name}"] = observe(lambda: x.reshape(4, 12).full_tensor())
        out[f"flatten {name}"] = observe(lambda: x.flatten().full_tensor())
        out[f"permute {name}"] = observe(lambda: x.view(8, 2, 3).permute(2, 0, 1).full_tensor())
        out[f"split {name}"] = observe(lambda: x.split(2, dim=1))
        out[f"chunk {name}"] = observe(lambda: x.chunk(2, dim=0))
        out[f"slice {name}"] = observe(lambda: x[:, 1:4])
        out[f"softmax {name}"] = observe(lambda: x.softmax(-1))
        out[f"log_softmax0 {name}"] = observe(lambda: x.log_softmax(0))
        out[f"cat {name}"] = observe(lambda: torch.cat([x, x * 2], dim=1))
        out[f"stack {name}"] = observe(lambda: torch.stack([x, x], dim=0))
    # Uneven rows: 7 over 3 or 4 ranks.
    u = T.distribute_tensor(torch.randn(7, 6), mesh, [S(0)] + rest)
    out["uneven sum0"] = observe(lambda: u.sum(0))
    out["uneven mean0"] = observe(lambda: u.mean(0))
    out["uneven view"] = observe(lambda: u.view(7, 2, 3))
    out["uneven flatten"] = observe(lambda: u.flatten(), message=False)
    out["uneven mm"] = observe(lambda: u @ T.distribute_tensor(w, mesh, [R()] * nd))
    # nn layers and a loss, forward and backward, against the same full tensors.
    torch.manual_seed(1)
    lin1, lin2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 5)
    emb = torch.nn.Embedding(10, 6)
    params = {
        "w1": T.distribute_tensor(lin1.weight.detach(), mesh, [S(0)] + rest),   # column-wise: output features
        "b1": T.distribute_tensor(lin1.bias.detach(), mesh, [S(0)] + rest),
        "w2": T.distribute_tensor(lin2.weight.detach(), mesh, [S(1)] + rest),   # row-wise: input features
        "b2": T.distribute_tensor(lin2.bias.detach(), mesh, [R()] * nd),
        "emb": T.distribute_tensor(emb.weight.detach(), mesh, [S(1)] + rest),
    }
    for p in params.values():
        p.requires_grad_(True)
    tokens = T.distribute_tensor(torch.randint(0, 10, (4, 3)), mesh, [R()] * nd)
    target = T.distribute_tensor(torch.randint(0, 5, (12,)), mesh, [R()] * nd)
    # On the 2x2 mesh PyTorch cuts replicated mesh dimensions where that is free (ties): compare values there.
    def show(t):
        return t if nd == 1 else t.full_tensor()
    h = F.embedding(tokens, params["emb"])
    out["embedding"] = observe(lambda: show(h))
    h = F.relu(F.linear(h, params["w1"], params["b1"]))
    out["linear colwise"] = observe(lambda: show(h))
    logits = F.linear(h, params["w2"], params["b2"])
    out["linear rowwise"] = observe(lambda: show(logits))
    loss = F.cross_entropy(logits.view(12, 5), target)
    out["loss"] = observe(lambda: show(loss))
    loss.backward()
    for key, p in params.items():
        out[f"grad {key}"] = observe(lambda: show(p.grad))
    lib.close()
    return out


@pytest.mark.parametrize("world,shape", MESHES)
def test_op_sharding_matches_torch(world, shape):
    compare(_ops, world, shape)


def _blocks(rank: int, world: int, lib_name: str, shape: tuple[int, ...]) -> dict:
    """What FSDP and tensor parallelism lean on: layer norm over a sequence-sharded input, parameter init,
    gradient clipping, state dicts and ``.data``. (Attention: PyTorch 2.13 has no rule for its CPU kernel;
    test_dtensor_misc checks torchdist's against plain tensors.)"""
    lib = Lib(lib_name, shape)
    T, S, R, mesh, nd = lib.T, lib.S, lib.R, lib.mesh, lib.ndim
    rest = [R()] * (nd - 1)
    out: dict = {}
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(6)
    x = T.distribute_tensor(torch.randn(2, 8, 6), mesh, [S(1)] + rest).requires_grad_(True)  # sequence parallel
    w = T.distribute_tensor(ln.weight.detach(), mesh, [R()] * nd).requires_grad_(True)
    b = T.distribute_tensor(ln.bias.detach() + 0.5, mesh, [R()] * nd).requires_grad_(True)
    y = F.layer_norm(x, (6,), w, b)
    out["layer_norm"] = observe(lambda: y)
    (y * y).sum().backward()
    out["layer_norm grads"] = observe(lambda: (x.grad, w.grad.full_tensor(), b.grad.full_tensor()))
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    for name, param in list(model.named_parameters()):
        module, leaf = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(module, leaf, torch.nn.Parameter(T.distribute_tensor(param.detach(), mesh, [S(0)] + rest)))
    out["state_dict"] = observe(lambda: sorted((k, tuple(str(p) for p in v.placements)) for k, v in
                                               model.state_dict().items()))
    torch.manual_seed(3)
    torch.nn.init.zeros_(model[1].bias)
    torch.nn.init.ones_(model[0].bias)
    out["init"] = observe(lambda: (model[1].bias, model[0].bias))
    sharded = {k: T.distribute_tensor(v * 2, mesh, [S(0)] + rest) for k, v in reference.items()}
    out["load_state_dict"] = observe(lambda: str(model.load_state_dict(sharded)))
    out["after load"] = observe(lambda: model[0].weight)
    data = model[0].bias.data
    out[".data"] = observe(lambda: (type(data).__name__, data, data.requires_grad))
    inp = T.distribute_tensor(torch.randn(5, 4), mesh, [R()] * nd)
    model(inp).sum().backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
    out["clip norm"] = observe(lambda: total.full_tensor())
    out["clipped grads"] = observe(lambda: [p.grad.full_tensor() for p in model.parameters()])
    lib.close()
    return out


@pytest.mark.parametrize("world,shape", [MESHES[1], MESHES[3]])
def test_building_blocks_match_torch(world, shape):
    compare(_blocks, world, shape)
