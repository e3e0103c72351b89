"""``format_utils``' broadcasting torch.save reader and the ``staging`` module, against PyTorch's.

Reader: a ``torch.save`` file is loaded through ``BroadcastingTorchSaveReader``
+ ``DynamicMetaLoadPlanner`` at world sizes 1-3: plain tensors on both
libraries (same tensors), DTensors (Shard(0) with uneven shards, Shard(1),
Replicate) on torchdist (PyTorch's reader hangs on gloo with DTensors: rank 1
broadcasts a DTensor, which never meets rank 0's plain broadcast), and the
errors of misuse, compared with PyTorch's where it raises them.
Staging: after ``async_save`` returns (or its staging future is done), the
caller changes its tensors and the checkpoint still holds the old values, for
each stager; the stagers' own behaviour is compared with PyTorch's.
"""

from __future__ import annotations

import importlib
import warnings
from concurrent.futures import Future

import pytest
import torch

import torchdist.checkpoint as dcp
from torchdist.checkpoint import format_utils, staging
from torchdist.testing import run_ranks

from ._common import assert_same, lib_modules, outcome, quiet

FULL = torch.arange(35.0).reshape(7, 5)
VEC = torch.linspace(-1.0, 1.0, 6)
INTS = torch.arange(8, dtype=torch.int32).reshape(2, 4)


def _saved_file(root) -> str:
    path = str(root / "model.pt")
    torch.save({"model": {"w": FULL, "v": VEC}, "ints": INTS, "step": 3}, path)
    return path


def _libs(lib: str):
    """(checkpoint, format_utils, c10d) of ``lib``; PyTorch's process group is made here (gloo)."""
    return lib_modules(lib, "checkpoint", "checkpoint.format_utils")


def _load(ckpt, fu, state, path, **reader_kwargs):
    ckpt.load(state, storage_reader=fu.BroadcastingTorchSaveReader(**reader_kwargs),
              planner=fu.DynamicMetaLoadPlanner(), checkpoint_id=path)
    return state


# -- the reader, on plain tensors and DTensors -------------------------------------------------------------------
def _plain_body(rank, world, lib, path, convert):
    ckpt, fu, c10d = _libs(lib)
    v_dtype, ints_dtype = (torch.float64, torch.float32) if convert else (torch.float32, torch.int32)
    state = {"model": {"w": torch.zeros(7, 5), "v": torch.zeros(6, dtype=v_dtype)},
             "ints": torch.zeros(2, 4, dtype=ints_dtype)}
    _load(ckpt, fu, state, path)
    if lib == "torch":
        c10d.destroy_process_group()
    return state


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plain_tensors_load_as_with_torch(tmp_path, world):
    path = _saved_file(tmp_path)
    want = run_ranks(_plain_body, world, args=("torch", path, False), timeout=60)
    got = run_ranks(_plain_body, world, args=("torchdist", path, False), backend="gloo", timeout=60)
    for rank in range(world):
        assert_same(got[rank], want[rank])
        assert_same(got[rank], {"model": {"w": FULL, "v": VEC}, "ints": INTS})
    # other dtypes than the file's: PyTorch's other ranks receive the file's bytes as the target's dtype (garbage);
    # torchdist broadcasts the file's dtype and copies into the target's
    converted = run_ranks(_plain_body, world, args=("torchdist", path, True), backend="gloo", timeout=60)
    for state in converted:
        assert_same(state, {"model": {"w": FULL, "v": VEC.double()}, "ints": INTS.float()})


def _dtensor_body(rank, world, path):
    from torchdist.device_mesh import init_device_mesh
    from torchdist.tensor import Replicate, Shard, distribute_tensor

    ckpt, fu, _ = _libs("torchdist")
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, placement in (("shard0", Shard(0)), ("shard1", Shard(1)), ("replicate", Replicate())):
        state = {"model": {"w": distribute_tensor(torch.zeros(7, 5), mesh, [placement]),
                           "v": distribute_tensor(torch.zeros(6), mesh, [Shard(0)])},
                 "ints": torch.zeros(2, 4, dtype=torch.int32)}
        _load(ckpt, fu, state, path)
        out[name] = (state["model"]["w"].to_local().clone(), state["model"]["v"].full_tensor(), state["ints"])
    return out


def _split(n: int, parts: int, index: int) -> slice:
    """torch.chunk's part ``index`` of ``n`` (the DTensor Shard rule)."""
    step = -(-n // parts)
    return slice(min(index * step, n), min((index + 1) * step, n))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_dtensors_load_each_rank_its_box(tmp_path, world):
    results = run_ranks(_dtensor_body, world, args=(_saved_file(tmp_path),), backend="gloo", timeout=90)
    for rank, out in enumerate(results):
        assert torch.equal(out["shard0"][0], FULL[_split(7, world, rank)]), (rank, out["shard0"][0])
        assert torch.equal(out["shard1"][0], FULL[:, _split(5, world, rank)]), (rank, out["shard1"][0])
        assert torch.equal(out["replicate"][0], FULL)
        for name in out:
            assert torch.equal(out[name][1], VEC) and torch.equal(out[name][2], INTS)


# -- misuse -------------------------------------------------------------------------------------------------------
def _misuse_body(rank, world, lib, path, case):
    ckpt, fu, c10d = _libs(lib)
    state = {"model": {"w": torch.zeros(7, 5), "v": torch.zeros(6)}}
    if case == "non_tensor_in_state_dict":
        state["step"] = 0
        result = outcome(_load, ckpt, fu, state, path)
    elif case == "coordinator_mismatch":
        result = outcome(_load, ckpt, fu, state, path, coordinator_rank=1)
    elif case == "no_checkpoint_id":
        result = outcome(ckpt.load, state, storage_reader=fu.BroadcastingTorchSaveReader(),
                         planner=fu.DynamicMetaLoadPlanner())
    else:  # without the planner, nothing describes the file: every key is missing
        result = outcome(ckpt.load, state, storage_reader=fu.BroadcastingTorchSaveReader(), checkpoint_id=path)
    if lib == "torch":
        c10d.destroy_process_group()
    return result


@pytest.mark.parametrize("case", ["non_tensor_in_state_dict", "coordinator_mismatch", "no_checkpoint_id",
                                  "default_planner"])
def test_misuse_fails_as_with_torch(tmp_path, case):
    path = _saved_file(tmp_path)
    want = run_ranks(_misuse_body, 2, args=("torch", path, case), timeout=60)
    got = run_ranks(_misuse_body, 2, args=("torchdist", path, case), backend="gloo", timeout=60)
    assert got == want
    assert all(kind == "CheckpointException" for kind, _ in got), got


def _file_mismatch_body(rank, world, path, case):
    ckpt, fu, _ = _libs("torchdist")
    if case == "non_tensor_in_file":
        state = {"step": torch.zeros(())}  # the file's "step" is an int
    else:
        shapes = {"missing_key": {"w": (7, 5), "nope": (2,)}, "bigger": {"w": (8, 5)}, "smaller": {"w": (7, 4)},
                  "fewer_dims": {"w": (35,)}}[case]
        state = {"model": {key: torch.zeros(shape) for key, shape in shapes.items()}}
    return outcome(_load, ckpt, fu, state, path)


@pytest.mark.parametrize("case", ["missing_key", "bigger", "smaller", "fewer_dims", "non_tensor_in_file"])
def test_a_file_that_does_not_fit_fails_on_every_rank(tmp_path, case):
    # PyTorch narrows a too-small target silently, and a missing key or a bigger one leaves the other ranks
    # waiting in a broadcast; torchdist checks the plans against the file before any broadcast
    got = run_ranks(_file_mismatch_body, 3, args=(_saved_file(tmp_path), case), backend="gloo", timeout=60)
    want = {"missing_key": ("RuntimeError", "Missing key in checkpoint state_dict: model.nope."),
            "bigger": ("ValueError", "Size mismatch between saved torch.Size([7, 5]) and current: "
                                     "torch.Size([8, 5]) for model.w"),
            "smaller": ("ValueError", "Size mismatch between saved torch.Size([7, 5]) and current: "
                                      "torch.Size([7, 4]) for model.w"),
            "fewer_dims": ("ValueError", "Size mismatch between saved torch.Size([7, 5]) and current: a 1-dim "
                                         "tensor for model.w"),
            "non_tensor_in_file": ("RuntimeError", "Non-tensor value identified at step. At this time "
                                                   "BroadcastingTorchSaveReader only supports loading Tensors.")}[case]
    assert got == [("CheckpointException", {0: want})] * 3


def test_reader_accepts_only_files_and_exports_torch_names(tmp_path):
    torch_fu = pytest.importorskip("torch.distributed.checkpoint.format_utils")
    assert format_utils.__all__ == torch_fu.__all__
    path = _saved_file(tmp_path)
    assert format_utils.BroadcastingTorchSaveReader.validate_checkpoint_id(path)
    assert not format_utils.BroadcastingTorchSaveReader.validate_checkpoint_id(str(tmp_path))
    reader = format_utils.BroadcastingTorchSaveReader(path)
    assert reader.read_metadata().state_dict_metadata == {}
    reader.reset(None)
    assert reader.checkpoint_id is None


# -- staging --------------------------------------------------------------------------------------------------------
def _stagers(lib):
    """name -> a new stager of ``lib`` (None: async_save's own)."""
    st = importlib.import_module(f"{lib}.checkpoint.staging")
    return {
        "none": lambda: None,
        "blocking": lambda: st.BlockingAsyncStager(),
        "blocking_cached": lambda: st.BlockingAsyncStager(cache_staged_state_dict=True),
        "default_sync": lambda: st.DefaultStager(st.StagingOptions(False, False, False, False)),
        "default_async": lambda: st.DefaultStager(st.StagingOptions(False, False, True, False)),
        "default_async_shared": lambda: st.DefaultStager(st.StagingOptions(False, True, True, False)),
    }


def _gated_writer(ckpt, path):
    """A FileSystemWriter of ``ckpt`` whose ``write_data`` waits for ``writer.gate``: the test changes the state
    first, so that a save of the caller's own tensors (no staging) would write the changed values."""
    import threading

    class GatedWriter(ckpt.FileSystemWriter):
        gate = threading.Event()

        def write_data(self, plan, planner):
            assert self.gate.wait(timeout=30), "the test never opened the gate"
            return super().write_data(plan, planner)

    return GatedWriter(path)


def _train_state():
    base = torch.arange(12.0)
    return {"model": {"w": base.reshape(3, 4), "row": base.reshape(3, 4)[1], "scalar": torch.tensor(2.5)},
            "optim": {"lr": 0.1, "hist": [1, 2]}, "ints": torch.arange(3)}


def _async_save_then_train(lib: str, stager_name: str, path) -> tuple[str, dict]:
    """async_save, change the state at once (after staging when it is in the background), load the result."""
    lib = "torch.distributed" if lib == "torch" else lib
    ckpt = importlib.import_module(f"{lib}.checkpoint")
    stager = _stagers(lib)[stager_name]()
    state = _train_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = _gated_writer(ckpt, path)
        returned = ckpt.async_save(state, storage_writer=writer, async_stager=stager, no_dist=True)
        if isinstance(returned, Future):
            kind, upload = "Future", returned
        else:
            kind, upload = type(returned).__name__, returned.upload_completion
            assert returned.staging_completion.result(timeout=30) is None
        state["model"]["w"].add_(100)  # the training step right after the save returned
        state["ints"].zero_()
        state["optim"]["hist"].append(3)
        state["optim"]["lr"] = 0.5
        writer.gate.set()
        upload.result(timeout=30)
        if stager is not None:
            stager.close()
        loaded = {"model": {"w": torch.zeros(3, 4), "row": torch.zeros(4), "scalar": torch.tensor(0.0)},
                  "optim": {"lr": 0.0, "hist": []}, "ints": torch.zeros(3, dtype=torch.int64)}
        ckpt.load(loaded, checkpoint_id=path, no_dist=True)
    return kind, loaded


@pytest.mark.parametrize("stager_name", list(_stagers("torchdist")))
def test_async_save_keeps_the_values_of_the_call(tmp_path, stager_name):
    kind, loaded = _async_save_then_train("torchdist", stager_name, tmp_path / "torchdist")
    want = _train_state()
    assert torch.equal(loaded["model"]["w"], want["model"]["w"]) and torch.equal(loaded["ints"], want["ints"])
    assert torch.equal(loaded["model"]["row"], want["model"]["row"]) and float(loaded["model"]["scalar"]) == 2.5
    assert loaded["optim"] == {"lr": 0.1, "hist": [1, 2]}
    if stager_name == "blocking_cached":
        return  # PyTorch pins its cache: without CUDA it raises (torchdist stages into ordinary memory)
    torch_kind, torch_loaded = _async_save_then_train("torch", stager_name, tmp_path / "torch")
    assert kind == torch_kind  # AsyncSaveResponse exactly when the stager stages in the background
    assert all(torch.equal(loaded["model"][k], torch_loaded["model"][k]) for k in ("w", "row", "scalar"))


def test_a_cached_stager_copies_each_save_into_the_same_tensors():
    stager = staging.BlockingAsyncStager(cache_staged_state_dict=True)
    state = {"w": torch.ones(3), "n": 1}
    first = stager.stage(state)
    state["w"].add_(1)
    second = stager.stage(state)
    assert second["w"].data_ptr() == first["w"].data_ptr() and torch.equal(second["w"], torch.full((3,), 2.0))
    assert second["w"].data_ptr() != state["w"].data_ptr()
    with pytest.raises(ValueError, match="for saves of one state_dict layout"):
        stager.stage({"w": torch.ones(4), "n": 1})


def _dtensor_async_body(rank, world, path, stager_name):
    from torchdist.device_mesh import init_device_mesh
    from torchdist.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    stager = _stagers("torchdist")[stager_name]()
    state = {"w": distribute_tensor(FULL.clone(), mesh, [Shard(0)]), "r": distribute_tensor(VEC.clone(), mesh,
                                                                                              [Replicate()])}
    writer = _gated_writer(dcp, path)
    returned = dcp.async_save(state, storage_writer=writer, async_stager=stager)
    if not isinstance(returned, Future):
        returned.staging_completion.result(timeout=30)
        returned = returned.upload_completion
    state["w"].to_local().mul_(-1)
    state["r"].to_local().add_(10)
    writer.gate.set()
    returned.result(timeout=30)
    if stager is not None:
        stager.close()
    target = {"w": distribute_tensor(torch.zeros(7, 5), mesh, [Replicate()]),
              "r": distribute_tensor(torch.zeros(6), mesh, [Shard(0)])}
    dcp.load(target, checkpoint_id=path)
    return target["w"].to_local(), target["r"].full_tensor()


@pytest.mark.parametrize("stager_name", ["none", "blocking", "default_async"])
def test_async_save_of_dtensors_keeps_the_values_of_the_call(tmp_path, stager_name):
    results = run_ranks(_dtensor_async_body, 2, args=(str(tmp_path / "ckpt"), stager_name), backend="gloo",
                        timeout=90)
    for w, r in results:
        assert torch.equal(w, FULL) and torch.equal(r, VEC)


def _stager_facts(lib: str) -> dict:
    """What the stagers of ``lib`` give for one state_dict: types, sharing, copies, errors."""
    st = importlib.import_module(f"{lib}.checkpoint.staging")

    class Custom:
        def __init__(self):
            self.items = [1]

    base = torch.arange(6.0)
    state = {"a": base, "view": base[2:4], "s": torch.tensor(2.5), "e": torch.zeros(0, 3),
             "t": (1, torch.ones(1)), "custom": Custom(), "p": torch.nn.Parameter(torch.ones(2))}
    facts = {"all": st.__all__, "options": repr(st.StagingOptions()).split("(", 1)[1]}
    for name, make in (("blocking", st.BlockingAsyncStager),
                       ("default", lambda: st.DefaultStager(st.StagingOptions(False, False, False, False)))):
        stager = make()
        staged = stager.stage(state)
        facts[name] = {
            "sync_after": stager.should_synchronize_after_execute, "is_stager": isinstance(stager, st.AsyncStager),
            "types": {k: type(v).__name__ for k, v in staged.items()},
            "new_storage": staged["a"].data_ptr() != base.data_ptr(),
            "views_share": staged["view"].untyped_storage().data_ptr() == staged["a"].untyped_storage().data_ptr(),
            "custom_copied": staged["custom"] is not state["custom"] and staged["custom"].items == [1],
            "grad": staged["p"].requires_grad, "values": [staged["view"].tolist(), staged["s"].item()]}
        stager.close()
    facts["type_check"] = outcome(st.BlockingAsyncStager(type_check=True).stage, state)

    class OnlyStage:
        def stage(self, state_dict):
            return state_dict

    facts["protocol"] = (isinstance(OnlyStage(), st.AsyncStager), outcome(st.AsyncStager.stage, OnlyStage(), {}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st.AsyncStager.synchronize_staging(OnlyStage())
    facts["deprecated"] = [w.category.__name__ for w in caught]
    if not torch.accelerator.is_available():
        facts["default_options"] = outcome(st.DefaultStager)
    writer = importlib.import_module(f"{lib}.checkpoint").FileSystemWriter(".", cache_staged_state_dict=True)
    facts["writer"] = (isinstance(writer, st.AsyncStager), isinstance(writer, st.BlockingAsyncStager),
                       writer.cache_staged_state_dict, writer.should_synchronize_after_execute)
    return facts


def test_stagers_behave_as_torchs():
    pytest.importorskip("torch.distributed.checkpoint.staging")
    got, want = _stager_facts("torchdist"), _stager_facts("torch.distributed")
    assert got == want
    assert got["default"]["views_share"] and not got["blocking"]["views_share"]
    assert got["type_check"][0] == "ValueError" and got["deprecated"] == ["FutureWarning"]


def test_async_save_result_kinds_and_staging_errors(tmp_path):
    response = quiet(dcp.async_save, {"w": torch.ones(2)}, checkpoint_id=tmp_path / "a", no_dist=True,
                     async_stager=staging.DefaultStager(staging.StagingOptions(False, False, True, False)))
    assert isinstance(response, dcp.state_dict_saver.AsyncSaveResponse)
    assert isinstance(response.upload_completion.result(timeout=30), dcp.Metadata)

    class Broken(staging.BlockingAsyncStager):
        def stage(self, state_dict):
            raise RuntimeError("out of host memory")

    with pytest.raises(RuntimeError, match="out of host memory"):  # staging runs in the caller, before returning
        quiet(dcp.async_save, {"w": torch.ones(2)}, checkpoint_id=tmp_path / "b", no_dist=True, async_stager=Broken())
    assert dcp.staging is staging and "AsyncSaveResponse" in dcp.state_dict_saver.__all__
