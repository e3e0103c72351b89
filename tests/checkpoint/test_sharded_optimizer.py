"""``load_sharded_optimizer_state_dict``: PyTorch's docstring workflow on torch (FSDP1, gloo) and on torchdist.

FSDP1 model + Adam, two steps; model and optimizer saved as SHARDED_STATE_DICT
with the library's ``checkpoint.save``; a fresh model and optimizer loaded
through ``load_sharded_optimizer_state_dict`` and ``optim_state_dict_to_load``.
The reloaded optimizer must hold the original's state and take the same next
step. One spawn per world size runs torch, then torchdist, then torchdist on
torch's checkpoint, in the same processes.
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
import warnings

import pytest
import torch
import torch.nn as nn

from torchdist.testing import free_port

from fsdp._common import OncePerWorldSize
from fsdp1._common import batches, loss_of, make_model

WORLD_SIZES = (2, 3)
USE_ORIG_PARAMS = (False, True)


def _libs(lib: str):
    root = "torch.distributed" if lib == "torch" else "torchdist"
    return (importlib.import_module(root), importlib.import_module(root + ".fsdp"),
            importlib.import_module(root + ".fsdp.wrap"), importlib.import_module(root + ".checkpoint"))


def _wrap(fsdp, wrap, uop: bool):
    return fsdp.FullyShardedDataParallel(make_model("mlp"), auto_wrap_policy=wrap.ModuleWrapPolicy({nn.Linear}),
                                         use_orig_params=uop, device_id=torch.device("cpu"))


def _step(model, opt, rank: int, world_size: int, batch: int) -> None:
    x, y = batches("mlp", world_size)[batch]
    loss_of("mlp", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
    opt.step()
    opt.zero_grad()


def _local(value):
    """This rank's part of a loaded state: a DTensor's local tensor, a ShardedTensor's one local shard."""
    if hasattr(value, "to_local"):
        return type(value).__name__, value.to_local().clone()
    if hasattr(value, "local_shards"):
        shards = value.local_shards()
        return type(value).__name__, shards[0].tensor.clone() if shards else None
    return type(value).__name__, value.clone() if torch.is_tensor(value) else value


def _load_fresh(lib: str, uop: bool, path: str, rank: int, world_size: int) -> dict:
    """The docstring's load half, in ``lib``, from the checkpoint at ``path``; returns what it observed."""
    c10d, fsdp, wrap, dcp = _libs(lib)
    FSDP, sharded = fsdp.FullyShardedDataParallel, fsdp.StateDictType.SHARDED_STATE_DICT
    fresh = _wrap(fsdp, wrap, uop)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
    seen: dict = {}
    with FSDP.state_dict_type(fresh, sharded):
        model_sd = fresh.state_dict()
        checkpoint = {"model": model_sd}
        dcp.load(checkpoint, storage_reader=dcp.FileSystemReader(path))
        fresh.load_state_dict(checkpoint["model"])
        optim_state = dcp.load_sharded_optimizer_state_dict(model_sd, optimizer_key="optim",
                                                            storage_reader=dcp.FileSystemReader(path))
        seen["top_keys"] = sorted(optim_state)
        loaded = optim_state["optim"]
        seen["loaded_state"] = {fqn: {k: _local(v) for k, v in entries.items()}
                                for fqn, entries in loaded["state"].items()}
        seen["loaded_groups"] = loaded["param_groups"]
        fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, loaded))
    seen["optim"] = _osd_copy(fresh_opt.state_dict())
    _step(fresh, fresh_opt, rank, world_size, 0)
    seen["after_step"] = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    return seen


def _osd_copy(osd: dict) -> dict:
    return {"state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for i, s in osd["state"].items()},
            "param_groups": [dict(g) for g in osd["param_groups"]]}


def _run(rank: int, world_size: int, lib: str, uop: bool, path: str) -> dict:
    """Train two steps, save model + optimizer sharded, reload into fresh ones; one more step on both."""
    c10d, fsdp, wrap, dcp = _libs(lib)
    FSDP, sharded = fsdp.FullyShardedDataParallel, fsdp.StateDictType.SHARDED_STATE_DICT
    model = _wrap(fsdp, wrap, uop)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for batch in range(2):
        _step(model, opt, rank, world_size, batch)
    with FSDP.state_dict_type(model, sharded):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    seen = {"optim": _osd_copy(opt.state_dict())}
    seen["reloaded"] = _load_fresh(lib, uop, path, rank, world_size)
    _step(model, opt, rank, world_size, 0)
    seen["after_step"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return seen


def _run_both(rank: int, world_size: int):
    """torch's observations, torchdist's, and torchdist's load of torch's checkpoints, per use_orig_params."""
    import torch.distributed as tdist

    import torchdist

    warnings.simplefilter("ignore")
    tdist.init_process_group("gloo")
    box = [(free_port(), [tempfile.mkdtemp(prefix="sharded-optim-") for _ in range(4)]) if rank == 0 else None]
    tdist.broadcast_object_list(box, src=0)
    port, dirs = box[0]
    torch_paths, ours_paths = dirs[:2], dirs[2:]
    try:
        want = {uop: _run(rank, world_size, "torch", uop, p) for uop, p in zip(USE_ORIG_PARAMS, torch_paths)}
        tdist.barrier()
    finally:
        tdist.destroy_process_group()
    torchdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    got = {uop: _run(rank, world_size, "torchdist", uop, p) for uop, p in zip(USE_ORIG_PARAMS, ours_paths)}
    for uop, p in zip(USE_ORIG_PARAMS, torch_paths):  # PyTorch's checkpoint, read by torchdist
        got[uop]["from_torch"] = _load_fresh("torchdist", uop, p, rank, world_size)
    torchdist.barrier()
    torchdist.destroy_process_group()
    if rank == 0:
        for p in dirs:
            shutil.rmtree(p, ignore_errors=True)
    return want, got


_results = OncePerWorldSize(_run_both)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def runs(request):
    return _results(request.param)


def _same(got, want, where: str, ordered: bool = True) -> None:
    """Equal nested values; with ``ordered=False`` dict keys may come in another order (a state loaded back
    gets its keys in the checkpoint's order, in torch too)."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        order = list if ordered else sorted
        assert order(got) == order(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            _same(got[key], want[key], f"{where}[{key!r}]", ordered)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]", ordered)
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=lambda m: f"{where}: {m}")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.parametrize("uop", USE_ORIG_PARAMS, ids=lambda u: f"orig{int(u)}")
def test_reloaded_optimizer_equals_original(runs, uop):
    world_size, want, got = runs
    for rank in range(world_size):
        for lib, seen in (("torch", want[rank][uop]), ("torchdist", got[rank][uop])):
            _same(seen["reloaded"]["optim"], seen["optim"], f"{lib} rank {rank} reloaded optimizer", ordered=False)
            _same(seen["reloaded"]["after_step"], seen["after_step"], f"{lib} rank {rank} next step")


@pytest.mark.parametrize("uop", USE_ORIG_PARAMS, ids=lambda u: f"orig{int(u)}")
def test_matches_torch(runs, uop):
    """The same loaded structure and local values as torch's (a DTensor where torch gives a ShardedTensor),
    the same optimizer state and parameters after the next step."""
    world_size, want, got = runs
    for rank in range(world_size):
        mine, theirs = got[rank][uop]["reloaded"], want[rank][uop]["reloaded"]
        assert mine["top_keys"] == theirs["top_keys"] == ["optim"]
        assert mine["loaded_groups"] == theirs["loaded_groups"]
        assert list(mine["loaded_state"]) == list(theirs["loaded_state"])
        for fqn, entries in theirs["loaded_state"].items():
            assert list(mine["loaded_state"][fqn]) == list(entries), fqn
            for key, (kind, value) in entries.items():
                my_kind, my_value = mine["loaded_state"][fqn][key]
                assert (my_kind, kind) in {("DTensor", "ShardedTensor"), ("Tensor", "Tensor")}, (fqn, key)
                if value is None:  # torch: a ShardedTensor with no local shard; torchdist: an empty local tensor
                    assert my_value.numel() == 0, (fqn, key)
                    continue
                _same(my_value, value, f"rank {rank} loaded {fqn}.{key}")
        # (the key order of a state that optim_state_dict_to_load gives differs: that is FSDP1's, not this API's)
        _same(mine["optim"], theirs["optim"], f"rank {rank} reloaded optimizer", ordered=False)
        _same(got[rank][uop]["after_step"], want[rank][uop]["after_step"], f"rank {rank} next step")


@pytest.mark.parametrize("uop", USE_ORIG_PARAMS, ids=lambda u: f"orig{int(u)}")
def test_torch_checkpoint_loads_in_torchdist(runs, uop):
    world_size, want, got = runs
    for rank in range(world_size):
        from_torch, theirs = got[rank][uop]["from_torch"], want[rank][uop]["reloaded"]
        _same(from_torch["optim"], theirs["optim"], f"rank {rank} optimizer from torch's checkpoint", ordered=False)
        _same(from_torch["after_step"], theirs["after_step"], f"rank {rank} next step")


def test_exported_like_torch():
    import torch.distributed.checkpoint as tdcp

    import torchdist.checkpoint as dcp
    import torchdist.checkpoint.optimizer as optimizer

    assert dcp.load_sharded_optimizer_state_dict is optimizer.load_sharded_optimizer_state_dict
    assert "load_sharded_optimizer_state_dict" in dcp.__all__
    assert optimizer.__all__ == tdcp.optimizer.__all__
    import inspect
    assert list(inspect.signature(dcp.load_sharded_optimizer_state_dict).parameters) == \
        list(inspect.signature(tdcp.load_sharded_optimizer_state_dict).parameters)
