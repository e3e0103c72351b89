"""Checkpoints across ranks: saved at one world size, loaded at another, compared with PyTorch's DCP on gloo.

Each ``_body`` runs under ``run_ranks`` once per library where PyTorch can
run it too (``lib="torch"`` initializes gloo itself). What is compared: the
files each rank writes and which rank wrote each item (replicated values
once, spread as PyTorch spreads them), the values every rank reads back, and
the errors every rank raises when one rank asks for a key the checkpoint
lacks. Sharded values use ``LocalShards`` (chunks + global offsets), saved by
3 ranks as rows and loaded by 2 ranks as columns, by 4, and by 1.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
from torch import nn

import torchdist.checkpoint as dcp
from torchdist.checkpoint._chunks import LocalShards
from torchdist.testing import run_ranks

from ._common import assert_same, outcome

FULL = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
SHORT = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])


def _libs(lib: str):
    """(checkpoint module, c10d module, state_dict module, DDP class) of ``lib``."""
    warnings.simplefilter("ignore")
    if lib == "torch":
        import torch.distributed as tdist
        import torch.distributed.checkpoint as tdcp
        import torch.distributed.checkpoint.state_dict as tsd

        tdist.init_process_group("gloo")
        return tdcp, tdist, tsd, nn.parallel.DistributedDataParallel
    import torchdist
    import torchdist.checkpoint.state_dict as sd

    return dcp, torchdist, sd, torchdist.DistributedDataParallel


def _replicated() -> dict:
    return {"w1": torch.arange(16.0).reshape(4, 4), "w2": torch.linspace(0, 1, 8), "b": torch.tensor([1, 2, 3]),
            "step": 5, "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}, "layers": [torch.ones(2), torch.zeros(3)]}


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's split of n into parts: (start, length) of part ``index`` (possibly empty)."""
    step = -(-n // parts)
    start = min(index * step, n)
    return start, min(step, n - start)


def _rows(rank: int, world: int, target: bool = False) -> LocalShards:
    start, length = _split(FULL.shape[0], world, rank)
    data = torch.zeros(length, FULL.shape[1]) if target else FULL[start:start + length].clone()
    return LocalShards(FULL.shape, [((start, 0), data)])


def _cols(rank: int, world: int) -> LocalShards:
    start, length = _split(FULL.shape[1], world, rank)
    return LocalShards(FULL.shape, [((0, start), torch.zeros(FULL.shape[0], length))])


def _where(metadata) -> dict:
    """Which file holds each item."""
    return {(i.fqn, None if i.offset is None else tuple(i.offset)): s.relative_path
            for i, s in metadata.storage_data.items()}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _steps(model, optimizer, rank, n, seed):
    torch.manual_seed(seed + rank)
    for _ in range(n):
        model(torch.randn(3, 4)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _save_body(rank, world, lib, path):
    """World 3: replicated + per-rank values (both libraries), row shards (torchdist), DDP model and optimizer."""
    ckpt, c10d, sd, ddp_class = _libs(lib)
    state = _replicated()
    state[f"rank{rank}"] = torch.full((2,), float(rank))
    if lib == "torchdist":
        state["sharded"] = _rows(rank, world)
    metadata = ckpt.save(state, checkpoint_id=os.path.join(path, "plain"))
    c10d.barrier()
    out = {"files": sorted(os.listdir(os.path.join(path, "plain"))), "where": _where(metadata)}

    ddp = ddp_class(_model())
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    _steps(ddp, optimizer, rank, 2, seed=10)
    model_sd, optim_sd = sd.get_state_dict(ddp, optimizer)
    out["model_keys"], out["optim_keys"] = list(model_sd), sorted(optim_sd["state"])
    out["saved_model"] = {k: v.clone() for k, v in model_sd.items()}
    ckpt.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "ddp"))
    _steps(ddp, optimizer, rank, 2, seed=20)  # move on, then restore
    state = {"model": sd.get_model_state_dict(ddp), "optim": sd.get_optimizer_state_dict(ddp, optimizer)}
    ckpt.load(state, checkpoint_id=os.path.join(path, "ddp"))
    sd.set_state_dict(ddp, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["restored_model"] = {k: v.clone() for k, v in sd.get_model_state_dict(ddp).items()}
    _steps(ddp, optimizer, rank, 1, seed=30)
    out["after_resume"] = {k: v.clone() for k, v in sd.get_model_state_dict(ddp).items()}
    # rank 0 alone holds the full state; the others pass {} and receive it
    options = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sd.set_model_state_dict(ddp, dict(out["saved_model"]) if rank == 0 else {}, options=options)  # torch renames
    out["broadcast"] = {k: v.clone() for k, v in sd.get_model_state_dict(ddp).items()}
    out["bad_options"] = outcome(sd.get_model_state_dict, ddp, options=sd.StateDictOptions(broadcast_from_rank0=True))
    if lib == "torch":
        c10d.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    """The world-3 checkpoints of both libraries (written once for this module), and what each rank saw."""
    root = tmp_path_factory.mktemp("world3")
    want = run_ranks(_save_body, 3, args=("torch", str(root / "torch")), timeout=90)
    got = run_ranks(_save_body, 3, args=("torchdist", str(root / "torchdist")), backend="gloo", timeout=90)
    yield root, got, want
    shutil.rmtree(root, ignore_errors=True)


def test_world3_save_matches_torch_and_ddp_resumes(world3):
    _, got, want = world3
    for rank in range(3):
        g, w = got[rank], want[rank]
        assert g["files"] == w["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
        sharded = {k: v for k, v in g["where"].items() if k[0] == "sharded"}
        assert sharded == {("sharded", (0, 0)): "__0_0.distcp", ("sharded", (3, 0)): "__1_0.distcp",
                           ("sharded", (6, 0)): "__2_0.distcp"}  # each rank writes its own rows
        assert {k: v for k, v in g["where"].items() if k[0] != "sharded"} == w["where"]  # dedup as PyTorch
        assert g["model_keys"] == w["model_keys"] == ["0.weight", "0.bias", "2.weight", "2.bias"]  # no "module."
        assert g["optim_keys"] == w["optim_keys"]
        for key in w["saved_model"]:
            torch.testing.assert_close(g["saved_model"][key], w["saved_model"][key])
        assert_same(g["restored_model"], g["saved_model"])
        assert_same(w["restored_model"], w["saved_model"])
        for key in w["after_resume"]:
            torch.testing.assert_close(g["after_resume"][key], w["after_resume"][key])
        assert_same(g["broadcast"], got[0]["saved_model"])
        assert_same(w["broadcast"], want[0]["saved_model"])
        assert g["bad_options"] == w["bad_options"] == (
            "ValueError", "full_state_dict must be True when broadcast_from_rank0 is True.")
    assert len({str(sorted(r["where"].values())) for r in got}) == 1  # every rank got the same metadata back


def _load_body(rank, world, lib, root):
    """World 2: read the world-3 checkpoints written by both libraries; then a key that only rank 1 asks for."""
    ckpt, c10d, _, _ = _libs(lib)
    out = {}
    for source in ("torch", "torchdist"):
        state = {key: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
                 for key, v in _replicated().items()}
        state["cfg"], state["layers"] = {"lr": None, "betas": None}, [torch.zeros(2), torch.zeros(3)]
        state["rank2"] = torch.zeros(2)  # written by a rank that does not exist here
        if source == "torchdist":
            state["sharded"] = _cols(rank, world) if lib == "torchdist" else torch.zeros_like(FULL)
        ckpt.load(state, checkpoint_id=os.path.join(root, source, "plain"))
        if isinstance(state.get("sharded"), LocalShards):
            state["sharded"] = state["sharded"].chunks[0].tensor
        out[source] = state
    request = {"w1": torch.zeros(4, 4)}
    if rank == 1:
        request["only_on_1"] = torch.zeros(1)
    out["error"] = outcome(ckpt.load, request, checkpoint_id=os.path.join(root, "torch", "plain"))
    # use_collectives=False: each rank writes and reads a checkpoint of its own values, with its own metadata
    local = os.path.join(root, f"local_{lib}")
    ckpt.save({"x": torch.full((3,), float(rank)), "r": rank}, checkpoint_id=local, use_collectives=False)
    c10d.barrier()
    out["local_files"] = sorted(os.listdir(local))
    back = {"x": torch.zeros(3), "r": None}
    ckpt.load(back, checkpoint_id=local)
    out["local"] = back
    if lib == "torch":
        c10d.destroy_process_group()
    return out


def test_world2_loads_world3_checkpoints_of_both_libraries(world3):
    root = world3[0]
    got = run_ranks(_load_body, 2, args=("torchdist", str(root)), backend="gloo", timeout=90)
    want = run_ranks(_load_body, 2, args=("torch", str(root)), timeout=90)
    expected = _replicated()
    expected["rank2"] = torch.full((2,), 2.0)
    for rank in range(2):
        for source in ("torch", "torchdist"):
            for lib_result in (got[rank][source], want[rank][source]):
                assert_same({k: v for k, v in lib_result.items() if k != "sharded"}, expected)
        start, length = _split(6, 2, rank)
        assert torch.equal(got[rank]["torchdist"]["sharded"], FULL[:, start:start + length])  # rows -> columns
        assert torch.equal(want[rank]["torchdist"]["sharded"], FULL)  # PyTorch reads our shards into a full tensor
        assert got[rank]["local_files"] == want[rank]["local_files"] == [
            "__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp"]
        assert_same(got[rank]["local"], {"x": torch.full((3,), float(rank)), "r": rank})
        assert_same(want[rank]["local"], got[rank]["local"])
        assert got[rank]["error"] == want[rank]["error"] == (
            "CheckpointException", {1: ("RuntimeError", "Missing key in checkpoint state_dict: only_on_1.")})


def _world4_body(rank, world, root):
    """World 4: async_save rows (7 rows as 2,2,2,1; 3 rows as 1,1,1,0: an empty shard), reload as 2x2 blocks."""
    start, length = _split(3, world, rank)
    short = LocalShards((3, 2), [((start, 0), SHORT[start:start + length].clone())])
    state = {"sharded": _rows(rank, world), "short": short, "step": 3, "mine": torch.tensor([rank])}
    future = dcp.async_save(state, checkpoint_id=os.path.join(root, "w4"))
    state["sharded"].chunks[0].tensor.add_(1000)  # after async_save returns, changes are not saved
    future.result(timeout=60)
    rows, cols = _split(7, 2, rank // 2), _split(6, 2, rank % 2)  # a 2x2 grid of blocks
    target = LocalShards(FULL.shape, [((rows[0], cols[0]), torch.zeros(rows[1], cols[1]))])
    loaded = {"sharded": target, "step": 0}
    dcp.load(loaded, checkpoint_id=os.path.join(root, "w4"))
    return target.chunks[0].tensor, loaded["step"], sorted(os.listdir(os.path.join(root, "w4")))


def _world1_body(rank, world, root):
    state = {"sharded": torch.zeros(7, 6), "short": torch.zeros(3, 2), "mine": torch.tensor([0])}
    dcp.load(state, checkpoint_id=os.path.join(root, "w4"))
    return state


def test_world4_async_save_loads_at_worlds_4_and_1(ckpt_dir):
    results = run_ranks(_world4_body, 4, args=(str(ckpt_dir),), backend="gloo", timeout=90)
    for rank, (block, step, files) in enumerate(results):
        rows, cols = _split(7, 2, rank // 2), _split(6, 2, rank % 2)
        assert torch.equal(block, FULL[rows[0]:rows[0] + rows[1], cols[0]:cols[0] + cols[1]])
        assert step == 3 and files == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    (with_group,) = run_ranks(_world1_body, 1, args=(str(ckpt_dir),), backend="gloo", timeout=60)
    alone = {"sharded": torch.zeros(7, 6), "short": torch.zeros(3, 2), "mine": torch.tensor([0])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(alone, checkpoint_id=ckpt_dir / "w4", no_dist=True)
    for state in (with_group, alone):
        assert torch.equal(state["sharded"], FULL) and torch.equal(state["short"], SHORT)
        assert state["mine"].item() in range(4)  # a per-rank value under one key: one rank's copy is kept
