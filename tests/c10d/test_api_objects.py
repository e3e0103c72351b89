"""Single-process behaviour of the c10d objects: ReduceOp, Backend, Work, and queries before init."""

import copy
import pickle
import threading
import time
from datetime import timedelta

import pytest
import torch

import torchdist as dist
from torchdist._process_group.work import Work
from torchdist.errors import DistBackendError


@pytest.mark.parametrize("name", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_reduce_op_members_are_instances_and_roundtrip(name):
    op = getattr(dist.ReduceOp, name)
    assert isinstance(op, dist.ReduceOp)
    assert dist.ReduceOp(op) == op
    assert op == dist.ReduceOp(op)
    assert copy.copy(dist.ReduceOp(op)) == op
    assert copy.deepcopy(dist.ReduceOp(op)) == op
    assert pickle.loads(pickle.dumps(dist.ReduceOp(op))) == op
    assert pickle.loads(pickle.dumps(op)) == op
    assert str(op) == f"{op}" == f"RedOpType.{name}"  # PyTorch's enum prints its name, not the int


def test_reduce_op_compares_unequal_to_unrelated_objects():
    assert dist.ReduceOp(dist.ReduceOp.SUM) != "SUM"
    assert dist.ReduceOp(dist.ReduceOp.SUM) != dist.ReduceOp.MAX
    premul = dist._make_nccl_premul_sum(0.5)
    assert premul.op == dist.ReduceOp.PREMUL_SUM and premul.factor == 0.5
    assert dist.supports_complex(dist.ReduceOp.SUM) and not dist.supports_complex(dist.ReduceOp.MAX)


def test_reduce_op_construction_calls_and_hashing_as_in_pytorch():
    R = dist.ReduceOp
    for bad in ((), (0,), ("SUM",), (R(R.SUM),)):  # PyTorch's binding takes a RedOpType member only
        with pytest.raises(TypeError):
            R(*bad)
    with pytest.raises(RuntimeError, match="_make_nccl_premul_sum"):
        R(R.PREMUL_SUM)  # a PREMUL_SUM without its factor
    premul = R.PREMUL_SUM(2.0)
    assert isinstance(premul, R) and premul.op == R.PREMUL_SUM and premul.factor == 2.0
    with pytest.raises(RuntimeError, match="Only PREMUL_SUM supports calling with a factor"):
        R.SUM(1.0)
    assert premul == R.PREMUL_SUM == R.PREMUL_SUM(3.0)  # equality and hash look at the kind only
    assert hash(R(R.SUM)) == hash(R.SUM) and {R(R.MAX): 1}[R.MAX] == 1


def test_deprecated_reduce_op_has_every_member_and_warns():
    with pytest.warns(FutureWarning, match="reduce_op` is deprecated"):
        assert dist.reduce_op.SUM is dist.ReduceOp.SUM
    with pytest.warns(FutureWarning):
        members = {name: getattr(dist.reduce_op, name) for name in
                   ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")}
    assert members == {name: getattr(dist.ReduceOp, name) for name in members}


def test_debug_level_from_the_environment_and_set_as_in_pytorch(monkeypatch):
    import logging
    before = dist.get_debug_level()
    try:
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")  # any case
        dist.set_debug_level_from_env()
        assert dist.get_debug_level() is dist.DebugLevel.DETAIL and str(dist.DebugLevel.DETAIL) == "DebugLevel.DETAIL"
        assert logging.getLogger("torchdist").level == logging.DEBUG
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "verbose")
        with pytest.raises(ValueError, match="must be OFF, INFO, or DETAIL"):
            dist.set_debug_level_from_env()
        with pytest.raises(TypeError):
            dist.set_debug_level("INFO")
        dist.set_debug_level(dist.DebugLevel.INFO)
        assert dist.get_debug_level() == 1 and logging.getLogger("torchdist").level == logging.INFO
    finally:
        dist.set_debug_level(before)
        logging.getLogger("torchdist").setLevel(logging.NOTSET)


def test_backend_names():
    assert dist.Backend("GLOO") == "gloo"
    assert dist.Backend("Tcp") == "tcp"
    for bad in (None, 3, ["gloo"]):
        with pytest.raises(ValueError, match="string-ish"):
            dist.Backend(bad)
    assert dist.BackendConfig("cpu:gloo,cuda:nccl").get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    for bad in ("cpu:gloo,", "cpu:gloo,cpu:tcp", "cpu-gloo:"):
        with pytest.raises(ValueError):
            dist.BackendConfig(bad)


@pytest.mark.parametrize("name, what", [("nccl", "NCCL"), ("ucc", "UCC"), ("xccl", "XCCL")])
def test_pytorchs_backends_that_torchdist_lacks_raise_runtime_error(name, what):
    """As a PyTorch built without them ("Distributed package doesn't have NCCL built in"),
    and the failed init leaves nothing behind: a later init works."""
    assert not dist.is_backend_available(name)
    with pytest.raises(RuntimeError, match=f"doesn't have {what}.*built in.*backend='gloo'"):
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()
    dist.init_process_group("cpu:gloo,cuda:" + name, store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_queries_before_init_raise():
    assert not dist.is_initialized()
    assert dist.is_available()
    for query in (dist.get_rank, dist.get_world_size, dist.get_backend):
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            query()


def test_get_node_local_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK"):
        dist.get_node_local_rank()
    assert dist.get_node_local_rank(fallback_rank=3) == 3
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist.get_node_local_rank(fallback_rank=3) == 1


def test_is_torchelastic_launched(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not dist.is_torchelastic_launched()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert dist.is_torchelastic_launched()


def test_work_lifecycle_and_future():
    out = torch.ones(2)
    work = Work("all_reduce", [out])
    future = work.get_future()
    assert not work.is_completed() and not future.done()
    threading.Timer(0.05, work._complete).start()
    assert work.wait() is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert future.wait()[0] is out
    assert work.result()[0] is out


def test_completed_work_has_every_attribute_of_work_and_shares_nothing_mutable():
    """Work.completed() keeps its state in the class (see work._CompletedWork): it must
    answer every attribute Work() sets, or a change to Work would break it silently."""
    out = torch.ones(2)
    fast, slow = Work.completed("all_reduce", [out]), Work("all_reduce", [out])
    for name in vars(slow):
        getattr(fast, name)
    assert fast.wait() and fast.is_completed() and fast.is_success() and fast.exception() is None
    assert fast.result()[0] is out and fast.get_future().wait()[0] is out
    other = Work.completed("broadcast")
    assert other.result() == [] and other.get_future() is not fast.get_future()
    seen = []
    fast._on_done(seen.append)
    assert seen == [fast]


def test_work_failure_is_reraised_everywhere():
    work = Work("broadcast")
    error = dist.DistBackendError("peer died")
    work._fail(error)
    with pytest.raises(dist.DistBackendError, match="peer died"):
        work.wait()
    assert work.exception() is error and not work.is_success()
    with pytest.raises(dist.DistBackendError, match="peer died"):
        work.get_future().wait()


def test_work_wait_timeout_names_the_op():
    work = Work("all_gather")
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match="all_gather did not complete"):
        work.wait(timedelta(milliseconds=100))
    assert time.monotonic() - start < 2


def test_init_process_group_argument_errors():
    store = dist.HashStore()
    with pytest.raises(AssertionError, match="both init_method and store"):  # PyTorch raises AssertionError
        dist.init_process_group(store=store, init_method="env://", rank=0, world_size=1)
    with pytest.raises(AssertionError, match="world_size must be positive"):
        dist.init_process_group(store=store, rank=0)
    with pytest.raises(AssertionError, match="rank must be non-negative"):
        dist.init_process_group(store=store, world_size=1)
    with pytest.raises(ValueError, match="out of range"):
        dist.init_process_group(store=store, rank=2, world_size=2)
    assert not dist.is_initialized()


def test_env_rendezvous_missing_variables(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="environment variable RANK expected, but not set"):
        dist.init_process_group("tcp")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE expected"):
        dist.init_process_group("tcp")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR expected"):
        dist.init_process_group("tcp")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="MASTER_PORT expected"):
        dist.init_process_group("tcp")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="rank 3 is out of range for world_size 1"):
        dist.init_process_group("tcp")
    assert not dist.is_initialized()


def test_rendezvous_url_errors():
    with pytest.raises(RuntimeError, match="No rendezvous handler for invalid://"):
        dist.rendezvous("invalid://")
    with pytest.raises(ValueError, match="port number missing"):
        next(dist.rendezvous("tcp://127.0.0.1?rank=0&world_size=1"))
    with pytest.raises(ValueError, match="rank parameter missing"):
        next(dist.rendezvous("tcp://127.0.0.1:1234?world_size=1"))
    with pytest.raises(ValueError, match="world size parameter missing"):
        next(dist.rendezvous("tcp://127.0.0.1:1234?rank=0"))
    with pytest.raises(ValueError, match="rank parameter missing"):
        next(dist.rendezvous("file:///tmp/x?world_size=1"))
    with pytest.raises(ValueError, match="path missing"):
        next(dist.rendezvous("file://?rank=0&world_size=1"))
    with pytest.raises(AssertionError, match="node-specific arguments"):
        dist.rendezvous("tcp://127.0.0.1:1234?rank=0&world_size=1", rank=0, world_size=1)


def test_register_rendezvous_handler_adds_a_scheme():
    store = dist.HashStore()

    def handler(url, **kwargs):
        yield store, 0, 1

    dist.register_rendezvous_handler("unittest-mem", handler)
    got_store, rank, world_size = next(dist.rendezvous("unittest-mem://anything"))
    assert (got_store, rank, world_size) == (store, 0, 1)
    with pytest.raises(RuntimeError, match="already registered"):
        dist.register_rendezvous_handler("unittest-mem", handler)


def test_pending_work_answers_as_pytorchs():
    """PyTorch's Work: result() does not wait (it raises while pending, and gives the
    outputs of a failed op), is_success() means "no error so far", a pending receive's
    source rank is -1, and get_future_result()/_get_duration() are not on CPU backends."""
    out = torch.ones(1)
    work, recv = Work("all_reduce", [out]), Work("recv", [out])
    with pytest.raises(RuntimeError, match="completed"):
        work.result()
    assert work.is_success() and recv.source_rank() == -1 and recv._source_rank() == -1
    with pytest.raises(RuntimeError):
        work.source_rank()  # not a receive
    for unsupported in (work.get_future_result, work._get_duration):
        with pytest.raises(RuntimeError):
            unsupported()
    work._fail(DistBackendError("peer died"))
    assert not work.is_success() and work.result() == [out]
    recv._complete(source_rank=2)
    assert recv.source_rank() == 2


def test_point_to_point_errors_name_the_call_that_was_made():
    """send's errors say send, recv's say recv (they said isend and irecv: the ops they post)."""
    dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for call in (dist.send, dist.recv, dist.isend, dist.irecv):
            with pytest.raises(TypeError, match=rf"^{call.__name__}: tensor must be a torch.Tensor"):
                call([1.0], 0)
            with pytest.raises(RuntimeError, match=rf"^{call.__name__}: invalid root rank"):
                call(torch.zeros(1), 5)
    finally:
        dist.destroy_process_group()
