"""HuggingFace safetensors checkpoints: torchdist's HuggingFaceStorageWriter/Reader against PyTorch 2.13's.

Single process: the same state_dict saved by both libraries gives the same
file names, the same headers (parsed: safetensors writes ``__metadata__`` in
hash order), the same tensor bytes and the same ``model.safetensors.index.json``;
each library loads the other's files, and ``safetensors.torch.load_file`` loads
torchdist's. World 2 and 3: DTensor Shard(0) state saved with
``save_distributed=True`` (sharded files; and consolidated into full tensors),
then loaded by the other library at the other world size, resharded.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import torchdist.checkpoint as dcp
from torchdist.testing import run_ranks

from ._common import lib_modules, outcome, quiet

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("torchdist.tensor")

from torchdist.checkpoint._hf_utils import read_header  # noqa: E402 - after the skip: needs nothing, but reads files

import torch.distributed.checkpoint as tdcp  # noqa: E402 - the reference implementation, for comparison only

MAPPING = {"w": 1, "i": 1, "h": 2, "b": 2, "s": 3}


def _state() -> dict[str, torch.Tensor]:
    """Tensors of the four dtypes HF checkpoints use (and a scalar and a non-contiguous view)."""
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 4, generator=gen), "i": torch.arange(10, dtype=torch.int64).reshape(2, 5)[:, ::2],
            "h": torch.randn(6, generator=gen).half(), "b": torch.randn(3, 3, generator=gen).bfloat16(),
            "s": torch.tensor(2.5)}


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: torch.zeros_like(value) for key, value in state.items()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key].contiguous()), f"{key}: {got[key]} != {want[key]}"


def _contents(directory) -> dict[str, object]:
    """Each file of ``directory``: a safetensors file as (parsed header, data bytes), another as its text."""
    out: dict[str, object] = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            continue
        if name.endswith(".safetensors"):
            header, start = read_header(path)
            extra = dict(header.pop("__metadata__", {}))
            if "DCP_SHARDING_INFO" in extra:
                extra["DCP_SHARDING_INFO"] = json.loads(extra["DCP_SHARDING_INFO"])
            with open(path, "rb") as stream:
                stream.seek(start)
                out[name] = (header, extra, stream.read())
        else:
            with open(path) as stream:
                out[name] = stream.read()
    return out


@pytest.mark.parametrize("mapping", [None, MAPPING], ids=["one_file", "three_files"])
def test_files_and_index_match_torch(tmp_path, mapping):
    state = _state()
    quiet(dcp.save, state, storage_writer=dcp.HuggingFaceStorageWriter(tmp_path / "td", mapping), no_dist=True)
    quiet(tdcp.save, state, storage_writer=tdcp.HuggingFaceStorageWriter(str(tmp_path / "t"), mapping), no_dist=True)
    got, want = _contents(tmp_path / "td"), _contents(tmp_path / "t")
    assert list(got) == list(want)
    assert len([name for name in got if name.startswith("model-")]) == (3 if mapping else 1)
    for name in want:
        assert got[name] == want[name], name
    index = json.loads(got["model.safetensors.index.json"])
    expected_files = {key: f"model-0000{mapping[key] if mapping else 1}-of-0000{3 if mapping else 1}.safetensors"
                      for key in state}
    assert index == {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                     "weight_map": expected_files}


@pytest.mark.parametrize("mapping", [None, MAPPING], ids=["one_file", "three_files"])
@pytest.mark.parametrize("writer_lib, reader_lib", [("torchdist", "torch"), ("torch", "torchdist")])
def test_single_process_interop(tmp_path, mapping, writer_lib, reader_lib):
    libs = {"torch": tdcp, "torchdist": dcp}
    writer, reader = libs[writer_lib], libs[reader_lib]
    state = _state()
    quiet(writer.save, state, storage_writer=writer.HuggingFaceStorageWriter(str(tmp_path), mapping), no_dist=True)
    got = _zeros(state)
    quiet(reader.load, got, storage_reader=reader.HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    _assert_equal(got, state)
    plain: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(tmp_path)):
        if name.endswith(".safetensors"):
            plain.update(safetensors_torch.load_file(str(tmp_path / name)))
    _assert_equal(plain, state)


def test_threads_write_and_read_several_files(tmp_path):
    state = {f"layer{i}.weight": torch.full((64, 8), float(i)) for i in range(8)}
    mapping = {key: i % 4 + 1 for i, key in enumerate(state)}
    writer = dcp.HuggingFaceStorageWriter(tmp_path, fqn_to_index_mapping=mapping, thread_count=3)
    quiet(dcp.save, state, storage_writer=writer, no_dist=True)
    assert sorted(os.listdir(tmp_path)) == [f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)] + [
        "model.safetensors.index.json"]
    for lib in (dcp, tdcp):
        got = _zeros(state)
        quiet(lib.load, got, storage_reader=lib.HuggingFaceStorageReader(str(tmp_path), thread_count=3), no_dist=True)
        _assert_equal(got, state)


def test_single_process_consolidation_matches_torch(tmp_path):
    """save_distributed + enable_consolidation in one process: shards in sharded/, full tensors beside them."""
    state = {key: value for key, value in _state().items() if key != "i"}  # PyTorch consolidates floats only
    mapping = {key: index for key, index in MAPPING.items() if key in state}
    for lib, name in ((dcp, "td"), (tdcp, "t")):
        writer = lib.HuggingFaceStorageWriter(str(tmp_path / name), mapping, save_distributed=True,
                                              enable_consolidation=True)
        quiet(lib.save, state, storage_writer=writer, no_dist=True)
    got, want = _contents(tmp_path / "td"), _contents(tmp_path / "t")
    assert list(got) == list(want)
    scalar_file = "model-00003-of-00003.safetensors"  # PyTorch 2.13 writes a 0-dim tensor's bytes as zeros here
    assert got.pop(scalar_file)[:2] == want.pop(scalar_file)[:2]
    assert got == want
    assert torch.equal(safetensors_torch.load_file(str(tmp_path / "td" / scalar_file))["s"], state["s"])
    assert _contents(tmp_path / "td" / "sharded") == _contents(tmp_path / "t" / "sharded")
    for name in ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"):  # byte for byte
        assert (tmp_path / "td" / name).read_bytes() == (tmp_path / "t" / name).read_bytes()
    got = _zeros(state)
    quiet(dcp.load, got, storage_reader=dcp.HuggingFaceStorageReader(tmp_path / "td"), no_dist=True)
    _assert_equal(got, state)


def test_load_with_a_missing_key_raises_like_torch(tmp_path):
    state = {"w": torch.ones(2, 2)}
    quiet(tdcp.save, state, storage_writer=tdcp.HuggingFaceStorageWriter(str(tmp_path)), no_dist=True)
    results = []
    for lib in (tdcp, dcp):
        target = {"w": torch.zeros(2, 2), "x": torch.zeros(3)}
        results.append(outcome(lib.load, target, storage_reader=lib.HuggingFaceStorageReader(str(tmp_path)),
                               no_dist=True))
    assert results[0][0] == "CheckpointException"
    assert results[1] == results[0]
    assert "Missing key in checkpoint state_dict: x." in str(results[1][1])


def test_missing_safetensors_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # "import safetensors" now raises ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    for make in (dcp.HuggingFaceStorageWriter, dcp.HuggingFaceStorageReader):
        with pytest.raises(ImportError, match="pip install safetensors"):
            make(tmp_path)


def test_non_tensor_values_and_unmapped_keys_are_refused(tmp_path):
    writer = dcp.HuggingFaceStorageWriter(tmp_path)
    with pytest.raises(dcp.CheckpointException, match="stores tensors only") as info:
        quiet(dcp.save, {"w": torch.ones(2), "step": 3}, storage_writer=writer, no_dist=True)
    writer = dcp.HuggingFaceStorageWriter(tmp_path, fqn_to_index_mapping={"w": 1})
    with pytest.raises(dcp.CheckpointException, match="not in fqn_to_index_mapping"):
        quiet(dcp.save, {"w": torch.ones(2), "v": torch.ones(1)}, storage_writer=writer, no_dist=True)
    assert not any(name.endswith(".safetensors") for name in os.listdir(tmp_path)), info.value


# -- world 2 and 3: DTensor Shard(0) state, saved by one library, loaded by the other at the other world size


def _sharded_state() -> dict[str, torch.Tensor]:
    """Full tensors that the ranks hold as Shard(0) DTensors (7 rows: uneven at world 2 and 3)."""
    return {"w": torch.arange(35.0).reshape(7, 5), "h": torch.linspace(-1, 1, 12).half().reshape(6, 2),
            "b": torch.arange(18.0).bfloat16().reshape(9, 2), "i": torch.arange(8, dtype=torch.int64) * 3}


def _distributed(tensor_mod, mesh, full: dict[str, torch.Tensor]) -> dict:
    return {key: tensor_mod.distribute_tensor(value, mesh, [tensor_mod.Shard(0)]) for key, value in full.items()}


def _save_body(rank, world, lib, root):
    """Save the state sharded (every key) and consolidated (floats: PyTorch's consolidation) to ``root``."""
    ckpt, tensor_mod, device_mesh, c10d = lib_modules(lib, "checkpoint", "tensor", "device_mesh")
    mesh = device_mesh.init_device_mesh("cpu", (world,))
    state = _distributed(tensor_mod, mesh, _sharded_state())
    ckpt.save(state, storage_writer=ckpt.HuggingFaceStorageWriter(os.path.join(root, "sharded"),
                                                                 save_distributed=True))
    floats = {key: value for key, value in state.items() if key != "i"}
    writer = ckpt.HuggingFaceStorageWriter(os.path.join(root, "consolidated"), {"w": 1, "h": 2, "b": 2},
                                           save_distributed=True, enable_consolidation=True)
    ckpt.save(floats, storage_writer=writer)
    refused = None
    if lib == "torchdist":  # two ranks writing the same model-00001-of-00001 file would lose data
        refused = outcome(ckpt.save, state, storage_writer=ckpt.HuggingFaceStorageWriter(os.path.join(root, "bad")))
    if lib == "torch":
        c10d.destroy_process_group()
    return refused


def _load_body(rank, world, lib, root):
    """Load both checkpoints of ``root`` into Shard(0) DTensors; return this rank's local shards."""
    ckpt, tensor_mod, device_mesh, c10d = lib_modules(lib, "checkpoint", "tensor", "device_mesh")
    mesh = device_mesh.init_device_mesh("cpu", (world,))
    out = {}
    for kind in ("sharded", "consolidated"):
        full = _sharded_state()
        if kind == "consolidated":
            del full["i"]
        target = _distributed(tensor_mod, mesh, {key: torch.zeros_like(value) for key, value in full.items()})
        ckpt.load(target, storage_reader=ckpt.HuggingFaceStorageReader(os.path.join(root, kind), thread_count=2))
        out[kind] = {key: value.to_local().clone() for key, value in target.items()}
    if lib == "torch":
        c10d.destroy_process_group()
    return out


def _expected_local(rank: int, world: int, full: torch.Tensor) -> torch.Tensor:
    chunks = torch.chunk(full, world)
    return chunks[rank] if rank < len(chunks) else full[:0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("save_world, load_world", [(2, 3), (3, 2)])
def test_sharded_interop_across_world_sizes(tmp_path, save_world, load_world):
    backends = {"torch": None, "torchdist": "gloo"}
    for lib in ("torchdist", "torch"):
        refused = run_ranks(_save_body, save_world, args=(lib, str(tmp_path / lib)), backend=backends[lib],
                            timeout=120)
        if lib == "torchdist":
            assert all(r[0] == "CheckpointException" and "save_distributed=True" in str(r[1]) for r in refused), refused
    # the same files as PyTorch's: sharded files per rank, consolidated ones (and the index) byte for byte
    for kind in ("sharded", "consolidated", "consolidated/sharded"):
        got, want = _contents(tmp_path / "torchdist" / kind), _contents(tmp_path / "torch" / kind)
        assert list(got) == list(want), kind
        assert got == want, kind
    assert sorted(os.listdir(tmp_path / "torch" / "sharded")) == [
        f"shard-0000{r}-model-00001-of-00001.safetensors" for r in range(1, save_world + 1)]
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        data = (tmp_path / "torchdist" / "consolidated" / name).read_bytes()
        assert data == (tmp_path / "torch" / "consolidated" / name).read_bytes(), name
    full = _sharded_state()
    plain = {**safetensors_torch.load_file(str(tmp_path / "torchdist/consolidated/model-00001-of-00002.safetensors")),
             **safetensors_torch.load_file(str(tmp_path / "torchdist/consolidated/model-00002-of-00002.safetensors"))}
    _assert_equal(plain, {key: value for key, value in full.items() if key != "i"})
    # each library loads the other's checkpoints, resharded to another world size
    for saver, loader in (("torchdist", "torch"), ("torch", "torchdist")):
        results = run_ranks(_load_body, load_world, args=(loader, str(tmp_path / saver)), backend=backends[loader],
                            timeout=120)
        for rank, out in enumerate(results):
            for kind, local in out.items():
                want = {key: _expected_local(rank, load_world, value) for key, value in full.items() if key in local}
                assert len(want) == (4 if kind == "sharded" else 3)
                _assert_equal(local, want)


def test_exported_like_torch():
    import torchdist.checkpoint.hf_storage as hf

    assert hf.HuggingFaceStorageWriter is dcp.HuggingFaceStorageWriter
    assert hf.HuggingFaceStorageReader is dcp.HuggingFaceStorageReader
    assert {"HuggingFaceStorageWriter", "HuggingFaceStorageReader"} <= set(dcp.__all__)
