"""One-process checkpoints: the same state_dicts saved and loaded by torchdist and by PyTorch's DCP, and each
library reading the other's files.

Everything here runs without a process group (``no_dist=True``), so it checks
the planners, the file layout, the metadata and the errors; the multi-rank
behaviour is in test_multirank.py.
"""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as tdcp
import torch.distributed.checkpoint._dedup_save_plans as torch_dedup
import torch.distributed.checkpoint._nested_dict as torch_nested
import torch.distributed.checkpoint.format_utils as torch_format_utils

import torchdist.checkpoint as dcp
from torchdist.checkpoint import format_utils
from torchdist.checkpoint._chunks import LocalShards, overlap
from torchdist.checkpoint._dedup import dedup_save_plans
from torchdist.checkpoint._pickling import load_metadata
from torchdist.checkpoint._traverse import flatten_state_dict, unflatten_state_dict
from torchdist.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torchdist.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ._common import assert_same, blank_like, outcome, quiet, sample_state


def _read_md(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return load_metadata(f)


def _storage_summary(md):
    return {(i.fqn, i.offset): (s.relative_path, s.offset, s.length) for i, s in md.storage_data.items()}


def test_save_writes_torchs_layout_and_metadata(ckpt_dir):
    mine, theirs = ckpt_dir / "mine", ckpt_dir / "theirs"
    returned = quiet(dcp.save, sample_state(), checkpoint_id=mine, no_dist=True)
    quiet(tdcp.save, sample_state(), checkpoint_id=theirs, no_dist=True)
    assert sorted(os.listdir(mine)) == sorted(os.listdir(theirs)) == [".metadata", "__0_0.distcp"]
    got, want = _read_md(mine), _read_md(theirs)  # torch's file read through our unpickler
    assert got.state_dict_metadata == want.state_dict_metadata
    assert "empty_dict" not in got.state_dict_metadata  # an empty mapping leaves no key, as in PyTorch
    assert got.planner_data == want.planner_data
    assert _storage_summary(got) == _storage_summary(want)  # same files, offsets and lengths: the same bytes
    assert got.version == want.version == "1.0.0"
    assert returned.state_dict_metadata == got.state_dict_metadata
    assert got.storage_meta.checkpoint_id == mine and got.storage_meta.save_id


def test_load_is_in_place_and_reads_either_librarys_files(ckpt_dir):
    quiet(dcp.save, sample_state(), checkpoint_id=ckpt_dir / "mine", no_dist=True)
    quiet(tdcp.save, sample_state(), checkpoint_id=ckpt_dir / "theirs", no_dist=True)
    want = sample_state()
    del want["empty_dict"]
    # PyTorch's quirk, kept: a non-tensor under an int key comes back under the str key
    want["int_keys"] = {0: want["int_keys"][0], 1: "placeholder", "1": "one"}
    for loader in (dcp.load, tdcp.load):
        for source in ("mine", "theirs"):
            target = blank_like(sample_state())
            del target["empty_dict"]
            weight = target["weight"]
            quiet(loader, target, checkpoint_id=ckpt_dir / source, no_dist=True)
            assert_same(target, want, f"{loader.__module__} loading {source}")
            assert target["weight"] is weight  # tensors are filled in place
    # plain pickle (as PyTorch reads .metadata) sees PyTorch's classes, and the file does not name torchdist
    with open(ckpt_dir / "mine" / ".metadata", "rb") as f:
        raw = f.read()
    assert isinstance(pickle.loads(raw), tdcp.Metadata) and b"torchdist" not in raw


def test_partial_loads_and_extra_keys_match_torch(ckpt_dir):
    quiet(dcp.save, {"a": torch.ones(2), "b": 3}, checkpoint_id=ckpt_dir, no_dist=True)
    results = []
    for lib in (dcp, tdcp):
        only_a = {"a": torch.zeros(2)}
        quiet(lib.load, only_a, checkpoint_id=ckpt_dir, no_dist=True)  # keys the checkpoint has beyond: ignored
        extra = {"a": torch.zeros(2), "c": torch.zeros(1)}
        quiet(lib.load, extra, checkpoint_id=ckpt_dir, planner=lib.DefaultLoadPlanner(allow_partial_load=True),
              no_dist=True)
        results.append((only_a, extra))
    assert_same(results[0], results[1])
    assert torch.equal(results[0][1]["a"], torch.ones(2)) and torch.equal(results[0][1]["c"], torch.zeros(1))


@pytest.mark.parametrize("case", ["missing_key", "wrong_shape", "no_checkpoint", "no_id", "overwrite"])
def test_errors_match_torch(ckpt_dir, case):
    quiet(dcp.save, {"a": torch.ones(2, 3), "b": 3}, checkpoint_id=ckpt_dir / "ck", no_dist=True)
    found = []
    for lib in (dcp, tdcp):
        if case == "missing_key":
            found.append(outcome(lib.load, {"a": torch.zeros(2, 3), "nope": torch.zeros(1)},
                                 checkpoint_id=ckpt_dir / "ck", no_dist=True))
        elif case == "wrong_shape":
            found.append(outcome(lib.load, {"a": torch.zeros(3, 2)}, checkpoint_id=ckpt_dir / "ck", no_dist=True))
        elif case == "no_checkpoint":
            with pytest.raises(BaseException) as info:
                quiet(lib.load, {"a": torch.zeros(2, 3)}, checkpoint_id=ckpt_dir / "none", no_dist=True)
            failure = info.value.failures[0][0]
            assert isinstance(failure, AssertionError) and "metadata is None" in str(failure)
            found.append(type(info.value).__name__)
            if lib is dcp:
                assert isinstance(failure, FileNotFoundError) and ".metadata" in str(failure)
        elif case == "no_id":
            found.append(outcome(lib.save, {"a": torch.ones(1)}, no_dist=True))
        else:
            found.append(outcome(lib.save, {"a": torch.ones(1)}, storage_writer=lib.FileSystemWriter(
                ckpt_dir / "ck", overwrite=False), no_dist=True)[0])
    assert found[0] == found[1]
    if case == "missing_key":
        assert found[0] == ("CheckpointException",
                            {0: ("RuntimeError", "Missing key in checkpoint state_dict: nope.")})


def test_stateful_values_are_called(ckpt_dir):
    class Counter:
        def __init__(self, n):
            self.n, self.loaded = n, None

        def state_dict(self):
            return {"n": torch.tensor([self.n]), "tag": f"c{self.n}"}

        def load_state_dict(self, sd):
            self.n, self.loaded = int(sd["n"]), sd["tag"]

    assert isinstance(Counter(1), dcp.Stateful)
    quiet(dcp.save, {"counter": Counter(5), "x": torch.ones(1)}, checkpoint_id=ckpt_dir, no_dist=True)
    for lib in (dcp, tdcp):
        counter = Counter(0)
        quiet(lib.load, {"counter": counter}, checkpoint_id=ckpt_dir, no_dist=True)
        assert (counter.n, counter.loaded) == (5, "c5")


@pytest.mark.parametrize("kind", ["THREAD", "PROCESS"])
def test_async_save_snapshots_the_values_when_called(ckpt_dir, kind):
    state = {"w": torch.ones(3), "step": 1}
    future = quiet(dcp.async_save, state, checkpoint_id=ckpt_dir, no_dist=True,
                   async_checkpointer_type=getattr(dcp.state_dict_saver.AsyncCheckpointerType, kind))
    state["w"].add_(100)  # the training loop goes on while the checkpoint is written
    metadata = future.result(timeout=30)
    assert isinstance(metadata, dcp.Metadata) and set(metadata.state_dict_metadata) == {"w", "step"}
    target = {"w": torch.zeros(3), "step": 0}
    quiet(tdcp.load, target, checkpoint_id=ckpt_dir, no_dist=True)
    assert torch.equal(target["w"], torch.ones(3)) and target["step"] == 1


def test_sharded_chunks_reshard_on_load(ckpt_dir):
    full = torch.arange(42.0).reshape(7, 6)
    rows = LocalShards(full.shape, [((0, 0), full[0:3].clone()), ((3, 0), full[3:7].clone())])
    quiet(dcp.save, {"t": rows}, checkpoint_id=ckpt_dir, no_dist=True)
    md = _read_md(ckpt_dir)
    assert md.state_dict_metadata["t"].size == full.shape
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata["t"].chunks] == [
        ((0, 0), (3, 6)), ((3, 0), (4, 6))]
    cols = LocalShards(full.shape, [((0, 0), torch.zeros(7, 2)), ((0, 2), torch.zeros(7, 4))])
    block = LocalShards(full.shape, [((2, 1), torch.zeros(3, 4))])
    quiet(dcp.load, {"t": cols}, checkpoint_id=ckpt_dir, no_dist=True)
    quiet(dcp.load, {"t": block}, checkpoint_id=ckpt_dir, no_dist=True)
    assert torch.equal(cols.chunks[0].tensor, full[:, :2]) and torch.equal(cols.chunks[1].tensor, full[:, 2:])
    assert torch.equal(block.chunks[0].tensor, full[2:5, 1:5])
    whole = {"t": torch.zeros(7, 6)}  # PyTorch reads the chunks into a plain tensor
    quiet(tdcp.load, whole, checkpoint_id=ckpt_dir, no_dist=True)
    assert torch.equal(whole["t"], full)


def test_global_plan_rejects_bad_tilings(ckpt_dir):
    full = torch.arange(8.0).reshape(4, 2)
    overlapping = LocalShards((4, 2), [((0, 0), full[0:3]), ((2, 0), full[2:4])])
    gap = LocalShards((4, 2), [((0, 0), full[0:1]), ((2, 0), full[2:4])])
    kind, failures = outcome(dcp.save, {"t": overlapping}, checkpoint_id=ckpt_dir, no_dist=True)
    assert kind == "CheckpointException" and "overlap" in failures[0][1]
    kind, failures = outcome(dcp.save, {"t": gap}, checkpoint_id=ckpt_dir, no_dist=True)
    assert kind == "CheckpointException" and "cover 6 of its 8 elements" in failures[0][1]
    with pytest.raises(ValueError, match="does not fit"):
        LocalShards((4, 2), [((3, 0), full[0:2])])


def test_overlap_boxes():
    assert overlap((0, 0), (3, 6), (2, 1), (3, 4)) == (torch.Size([2, 1]), torch.Size([0, 0]), torch.Size([1, 4]))
    assert overlap((0,), (3,), (3,), (2,)) is None  # touching is not overlapping
    assert overlap((), (), (), ()) == (torch.Size([]), torch.Size([]), torch.Size([]))  # 0-dim tensors


def _plan(*items):
    return SavePlan([WriteItem(MetadataIndex(fqn, (0,)), WriteItemType.TENSOR, tensor_data=TensorWriteData(
        ChunkStorageMetadata(torch.Size([0]), torch.Size([n])), TensorProperties(), torch.Size([n])))
        for fqn, n in items])


@pytest.mark.parametrize("lowest", [False, True])
def test_dedup_matches_torch(lowest):
    plans = [_plan(("a", 10), ("b", 10), ("c", 4), ("d", 1)), _plan(("a", 10), ("b", 10), ("c", 4)),
             _plan(("b", 10), ("e", 2))]
    ours = [[item.index.fqn for item in plan.items] for plan in dedup_save_plans(plans, lowest)]
    theirs = [[item.index.fqn for item in plan.items] for plan in torch_dedup.dedup_save_plans(plans, lowest)]
    assert ours == theirs
    assert sorted(sum(ours, [])) == ["a", "b", "c", "d", "e"]


def test_flatten_matches_torch():
    state = sample_state()
    flat, mapping = flatten_state_dict(state)
    want_flat, want_mapping = torch_nested.flatten_state_dict(state)
    assert list(flat) == list(want_flat) and mapping == want_mapping
    assert_same(unflatten_state_dict(flat, mapping), torch_nested.unflatten_state_dict(want_flat, want_mapping))


def test_format_utils_match_torch(ckpt_dir):
    quiet(tdcp.save, sample_state(), checkpoint_id=ckpt_dir / "theirs", no_dist=True)
    format_utils.dcp_to_torch_save(ckpt_dir / "theirs", ckpt_dir / "ours.pt")
    quiet(torch_format_utils.dcp_to_torch_save, ckpt_dir / "theirs", ckpt_dir / "theirs.pt")
    ours = torch.load(ckpt_dir / "ours.pt", weights_only=False)
    assert_same(ours, torch.load(ckpt_dir / "theirs.pt", weights_only=False))
    format_utils.torch_save_to_dcp(ckpt_dir / "ours.pt", ckpt_dir / "back")
    target = blank_like(ours)
    quiet(tdcp.load, target, checkpoint_id=ckpt_dir / "back", no_dist=True)
    assert_same(target, ours)


def test_storage_writer_options(ckpt_dir):
    state = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(5)}
    state["obj"] = {"k": 1}
    writer = dcp.FileSystemWriter(ckpt_dir / "threads", thread_count=3, sync_files=False)
    quiet(dcp.save, state, storage_writer=writer, no_dist=True)
    assert sorted(os.listdir(ckpt_dir / "threads")) == [".metadata", "__0_0.distcp", "__0_1.distcp",
                                                        "__0_2.distcp"]
    quiet(dcp.save, state, storage_writer=dcp.FileSystemWriter(ckpt_dir / "per_item", single_file_per_rank=False),
          no_dist=True)
    assert len(os.listdir(ckpt_dir / "per_item")) == 1 + len(state)
    for name in ("threads", "per_item"):
        target = blank_like(state)
        quiet(tdcp.load, target, checkpoint_id=ckpt_dir / name, no_dist=True)
        assert_same(target, state)
    with pytest.raises(ValueError, match="thread_count"):
        dcp.FileSystemWriter(ckpt_dir, thread_count=0)


def test_metadata_classes_pickle_like_torchs():
    props = TensorProperties(dtype=torch.float16, memory_format=torch.channels_last)
    buffer = io.BytesIO()
    pickle.dump(props, buffer)
    assert props.__getstate__()[:3] == (torch.float16, torch.strided, False)
    assert pickle.loads(buffer.getvalue()) == props
    assert MetadataIndex("a", [1, 2], index=5) == MetadataIndex("a", torch.Size([1, 2]))  # the hint is not compared
    assert hash(MetadataIndex("a", [1, 2], index=5)) == hash(MetadataIndex("a", (1, 2)))


def test_replicas_that_disagree_are_an_error():
    planner = dcp.DefaultSavePlanner()
    plans = [_plan(("w", 4), ("b", 2)), _plan(("w", 4), ("b", 3))]  # rank 1's "b" has another shape
    with pytest.raises(ValueError, match=r"ranks 0 and 1 both hold 'b'.*\(\(2,\), \(2,\), torch.float32\) and "
                                         r"\(\(3,\), \(3,\), torch.float32\)"):
        planner.create_global_plan(plans)
    new_plans, metadata = planner.create_global_plan([_plan(("w", 4), ("b", 2)), _plan(("w", 4), ("b", 2))])
    assert [[i.index.fqn for i in p.items] for p in new_plans] == [["w"], ["b"]]  # written once, spread
    assert set(metadata.state_dict_metadata) == {"w", "b"} and metadata.version == "1.0.0"
