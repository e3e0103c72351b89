"""DTensor checkpoints: saved with one placement, loaded into another, compared with PyTorch's DTensor + DCP.

World 2 (both libraries): a Shard(0) tensor with an uneven last shard and a
Replicate one are saved; each rank's chunks and files must be PyTorch's; the
checkpoint loads into Shard(1), Replicate and Shard(0). World 4 (torchdist):
the world-2 checkpoint loads into a 2x2 mesh as [Shard(0), Shard(1)], and a
model with DTensor parameters goes through full_state_dict get/set.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from torchdist.testing import run_ranks

from ._common import lib_modules

pytest.importorskip("torchdist.tensor")

FULL = torch.arange(35.0).reshape(7, 5)
REPLICATED = torch.linspace(-1, 1, 6)


def _libs(lib: str):
    """(checkpoint, state_dict, tensor, device_mesh, c10d) modules of ``lib``."""
    return lib_modules(lib, "checkpoint", "checkpoint.state_dict", "tensor", "device_mesh")


def _chunks(metadata, key):
    return [(tuple(c.offsets), tuple(c.sizes)) for c in metadata.state_dict_metadata[key].chunks]


def _world2_body(rank, world, lib, root):
    ckpt, sd, tensor, device_mesh, c10d = _libs(lib)
    mesh = device_mesh.init_device_mesh("cpu", (world,))
    state = {"t": tensor.distribute_tensor(FULL, mesh, [tensor.Shard(0)]),
             "r": tensor.distribute_tensor(REPLICATED, mesh, [tensor.Replicate()]), "step": 4}
    metadata = ckpt.save(state, checkpoint_id=root)
    out = {"chunks": _chunks(metadata, "t"), "r_chunks": _chunks(metadata, "r"),
           "where": sorted((i.fqn, tuple(i.offset or ()), s.relative_path) for i, s in metadata.storage_data.items())}
    targets = (("shard1", tensor.Shard(1)), ("replicate", tensor.Replicate()), ("shard0", tensor.Shard(0)))
    for name, placement in targets:
        target = {"t": tensor.distribute_tensor(torch.zeros(7, 5), mesh, [placement]),
                  "r": tensor.distribute_tensor(torch.zeros(6), mesh, [tensor.Shard(0)]), "step": 0}
        ckpt.load(target, checkpoint_id=root)
        out[name] = (target["t"].to_local().clone(), target["r"].to_local().clone(), target["step"])
    # a model with a DTensor parameter and its Adam state, saved through the state_dict helpers
    model, optimizer = _sharded_model(tensor, mesh, [tensor.Shard(0)])
    model.proj.weight.grad = tensor.distribute_tensor(torch.ones(6, 4), mesh, [tensor.Shard(0)])
    optimizer.step()
    model_sd, optim_sd = sd.get_state_dict(model, optimizer)
    ckpt.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root + "_model")
    out["weight"] = model.proj.weight.full_tensor()
    out["exp_avg"] = optim_sd["state"]["proj.weight"]["exp_avg"].full_tensor()
    if lib == "torch":
        c10d.destroy_process_group()
    return out


def _sharded_model(tensor, mesh, placements):
    torch.manual_seed(0)
    model = _Tiny()
    model.proj.weight = nn.Parameter(tensor.distribute_tensor(model.proj.weight.detach(), mesh, placements))
    return model, torch.optim.Adam(model.parameters(), lr=0.1, foreach=False)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Both libraries' world-2 DTensor checkpoints (written once for this module), and what each rank saw."""
    root = tmp_path_factory.mktemp("dtensor")
    want = run_ranks(_world2_body, 2, args=("torch", str(root / "torch")), timeout=90)
    got = run_ranks(_world2_body, 2, args=("torchdist", str(root / "torchdist")), backend="gloo", timeout=90)
    yield root, got, want
    shutil.rmtree(root, ignore_errors=True)


def test_world2_placements_match_torch(world2):
    _, got, want = world2
    for rank in range(2):
        g, w = got[rank], want[rank]
        assert g["chunks"] == w["chunks"] == [((0, 0), (4, 5)), ((4, 0), (3, 5))]  # each rank its rows
        assert g["r_chunks"] == w["r_chunks"] == [((0,), (6,))]  # a replicated DTensor is written once
        assert g["where"] == w["where"]
        assert torch.equal(g["weight"], w["weight"]) and torch.equal(g["exp_avg"], w["exp_avg"])
        for name in ("shard1", "replicate", "shard0"):
            for got_value, want_value in zip(g[name], w[name]):
                assert type(got_value) is type(want_value)
                assert torch.equal(got_value, want_value) if isinstance(want_value, torch.Tensor) else (
                    got_value == want_value), (rank, name)
    assert torch.equal(got[0]["shard0"][0], FULL[:4]) and torch.equal(got[1]["shard1"][0], FULL[:, 3:])


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6, bias=False)


def _world4_body(rank, world, root):
    ckpt, sd, tensor, device_mesh, _ = _libs("torchdist")
    mesh = device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    target = tensor.distribute_tensor(torch.zeros(7, 5), mesh, [tensor.Shard(0), tensor.Shard(1)])
    ckpt.load({"t": target}, checkpoint_id=os.path.join(root, "torchdist"))  # written by 2 ranks as rows
    block = target.to_local().clone()

    torch.manual_seed(0)
    model = _Tiny()
    full_weight = model.proj.weight.detach().clone()
    model.proj.weight = nn.Parameter(tensor.distribute_tensor(model.proj.weight.detach(), mesh,
                                                              [tensor.Replicate(), tensor.Shard(0)]))
    full = sd.get_model_state_dict(model, options=sd.StateDictOptions(full_state_dict=True))
    model.proj.weight.data.to_local().zero_()
    sd.set_model_state_dict(model, {"proj.weight": full_weight * 2},
                            options=sd.StateDictOptions(full_state_dict=True))
    after_set = model.proj.weight.full_tensor()

    # the world-2 Shard(0) model and Adam state, loaded into [Replicate, Shard(1)] on the 2x2 mesh
    model, optimizer = _sharded_model(tensor, mesh, [tensor.Replicate(), tensor.Shard(1)])
    model_sd, optim_sd = sd.get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    ckpt.load(state, checkpoint_id=os.path.join(root, "torchdist_model"))
    sd.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    exp_avg = optimizer.state[model.proj.weight]["exp_avg"]
    resumed = (model.proj.weight.full_tensor(), exp_avg.full_tensor(), tuple(exp_avg.placements))
    return block, type(full["proj.weight"]).__name__, full["proj.weight"], full_weight, after_set, resumed


def test_world4_loads_into_a_2d_mesh_and_full_state_dicts(world2):
    results = run_ranks(_world4_body, 4, args=(str(world2[0]),), backend="gloo", timeout=90)
    saved = world2[1][0]
    for rank, (block, kind, full, weight, after_set, resumed) in enumerate(results):
        dp, tp = divmod(rank, 2)
        rows, cols = (slice(0, 4), slice(4, 7))[dp], (slice(0, 3), slice(3, 5))[tp]
        assert torch.equal(block, FULL[rows, cols])
        assert kind == "Tensor" and torch.equal(full, weight)  # full_state_dict: a plain full tensor
        assert torch.equal(after_set, weight * 2)  # a full tensor set into a sharded parameter
        assert torch.equal(resumed[0], saved["weight"]) and torch.equal(resumed[1], saved["exp_avg"])
        assert [repr(p) for p in resumed[2]] == ["Replicate()", "Shard(dim=1)"]  # the loading placements stay
