"""Pipelined training equals unpipelined training; torchdist.pipelining behaves as torch.distributed.pipelining.

Each ``_body_*`` runs under ``run_ranks`` and does many checks in one spawn
(the suite's time budget): it trains ``_common.full_model`` with several
schedules and returns what every rank saw; the tests compare that with the
unsplit model trained on the same microbatches (and, for GPipe and 1F1B at
world 2 and DualPipeV at worlds 1-3, with torch.distributed.pipelining on gloo).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchdist.pipelining import _plans
from torchdist.pipelining.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks
from torchdist.testing import run_ranks

from ._common import BATCH, WIDTH, assert_matches_reference, batch, full_model, libs, train

# (schedule, stages, microbatches, static shapes, steps) per world size
_RUNS = {
    1: [("GPipe", 1, 2, False, 1), ("Interleaved1F1B", 2, 2, False, 1), ("ZBVZeroBubble", 2, 4, False, 1)],
    2: [("GPipe", 2, 4, False, 2), ("1F1B", 2, 4, True, 1), ("Interleaved1F1B", 4, 4, False, 1),
        ("LoopedBFS", 4, 2, True, 1), ("InterleavedZeroBubble", 4, 4, False, 1), ("ZBVZeroBubble", 4, 8, False, 1)],
    3: [("GPipe", 3, 4, False, 1), ("1F1B", 3, 8, False, 1), ("Interleaved1F1B", 6, 4, True, 1)],
    4: [("1F1B", 4, 4, False, 1), ("Interleaved1F1B", 8, 8, False, 1), ("LoopedBFS", 8, 4, False, 1)],
}


def _body_train(rank, world_size, lib, runs):
    dist, pp = libs(lib)
    out = [train(pp, dist, name, stages, mbs, steps=steps, static=static) for name, stages, mbs, static, steps in runs]
    if lib == "torch":
        dist.destroy_process_group()
    return out


def _check_world(world_size):
    runs = _RUNS[world_size]
    results = run_ranks(_body_train, world_size, args=("torchdist", runs), backend="gloo", timeout=90)
    for i, (name, stages, mbs, _, steps) in enumerate(runs):
        assert_matches_reference([r[i] for r in results], stages, mbs, steps)
    return results


def test_world_1_local_handoff_between_stages_on_one_rank():
    _check_world(1)


def test_world_2_every_schedule_and_same_as_torch_for_gpipe_and_1f1b():
    got = _check_world(2)
    runs = _RUNS[2][:2]
    want = run_ranks(_body_train, 2, args=("torch", runs), timeout=90)
    for i, (name, stages, mbs, _, steps) in enumerate(runs):
        assert_matches_reference([r[i] for r in want], stages, mbs, steps)  # the reference is torch's too
        for g, w in zip(got, want):
            assert g[i]["grads"].keys() == w[i]["grads"].keys()
            for key in w[i]["grads"]:
                torch.testing.assert_close(g[i]["grads"][key], w[i]["grads"][key])
            for a, b in zip(g[i]["losses"], w[i]["losses"]):
                torch.testing.assert_close(a, b)


def test_world_3():
    _check_world(3)


def test_world_4():
    _check_world(4)


# -- DualPipeV: V placement (rank r holds stages r and 2P - 1 - r), compared with the model and with torch -----
_DUALPIPE_V_RUNS = {1: [("DualPipeV", 2, 2, False, 2), ("DualPipeV", 2, 4, True, 1)],
                    2: [("DualPipeV", 4, 4, False, 2), ("DualPipeV", 4, 8, True, 1)],
                    3: [("DualPipeV", 6, 8, False, 1)]}


def _body_dualpipe_v(rank, world_size, lib):
    dist, pp = libs(lib)
    # torch 2.13's DualPipeV.eval() fails (its runtime still runs backwards): eval is checked on torchdist only
    out = [train(pp, dist, name, stages, mbs, steps=steps, static=static, evaluate=lib == "torchdist")
           for name, stages, mbs, static, steps in _DUALPIPE_V_RUNS[world_size]]
    if lib == "torch":
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world_size", sorted(_DUALPIPE_V_RUNS))
def test_dualpipe_v_trains_like_the_model_and_like_torch(world_size):
    got = run_ranks(_body_dualpipe_v, world_size, args=("torchdist",), backend="gloo", timeout=90)
    want = run_ranks(_body_dualpipe_v, world_size, args=("torch",), timeout=90)  # torch's runs on CPU with gloo
    for i, (_, num_stages, n_mb, _, steps) in enumerate(_DUALPIPE_V_RUNS[world_size]):
        assert_matches_reference([r[i] for r in got], num_stages, n_mb, steps)
        assert_matches_reference([r[i] for r in want], num_stages, n_mb, steps)
        for g, w in zip(got, want):
            assert g[i]["grads"].keys() == w[i]["grads"].keys()
            for key in w[i]["grads"]:
                torch.testing.assert_close(g[i]["grads"][key], w[i]["grads"][key], msg=key)
            for a, b in zip(g[i]["losses"], w[i]["losses"], strict=True):
                torch.testing.assert_close(a, b)
        with torch.no_grad():  # eval ran before the step, forwards only (the OVERLAP_F_Bs without their B)
            torch.testing.assert_close(got[0][i]["eval"], full_model(num_stages)(batch()[0]))
        assert all(r[i]["eval"] is None for r in got[1:])


# -- plans and microbatches, without processes ------------------------------------------------------------
def test_every_plan_runs_without_deadlock_and_covers_every_microbatch():
    for pp in range(1, 5):
        for v in (1, 2, 3):
            stages = pp * v
            loop = _plans.stage_to_rank(pp, stages)
            for m in range(1, 9):
                plans = {r: _plans.looped_bfs(r, pp, v, m) for r in range(pp)}
                _plans.simulate(plans, loop, stages)
                rounds = max(1, m // pp)
                if m % rounds == 0:
                    inter = {r: _plans.interleaved_1f1b(r, pp, v, m, m // rounds) for r in range(pp)}
                    for r in range(pp):
                        assert sorted(map(tuple, inter[r])) == sorted(map(tuple, plans[r]))
                    _plans.simulate(inter, loop, stages)
                    zb = _plans.zero_bubble(stages, pp, m, loop, lambda r: v * (m // rounds) + 2 * (pp - 1 - r) + 1)
                    assert sum(map(len, zb.values())) == 3 * stages * m
                    _plans.simulate(zb, loop, stages)
                if v == 1:
                    _plans.simulate({r: _plans.gpipe(r, m) for r in range(pp)}, loop, stages)
                    if m >= stages:
                        _plans.simulate({r: _plans.one_f_one_b(r, stages, m) for r in range(pp)}, loop, stages)
                if v == 2:
                    vee = _plans.stage_to_rank(pp, stages, "v")
                    _plans.simulate(_plans.zero_bubble(stages, pp, m, vee, lambda r: 2 * pp), vee, stages)
    # one rank's 1F1B: warmup of num_stages - stage forwards, then alternate
    assert [repr(a) for a in _plans.one_f_one_b(0, 2, 3)] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]


def test_a_plan_that_waits_on_itself_is_reported():
    placement = {0: 0, 1: 1}
    bad = {0: [_plans._Action(0, _plans.B, 0), _plans._Action(0, _plans.F, 0)],
           1: [_plans._Action(1, _plans.F, 0), _plans._Action(1, _plans.B, 0)]}
    try:
        _plans.simulate(bad, placement, 2)
    except RuntimeError as exc:
        assert "deadlocks" in str(exc)
    else:
        raise AssertionError("a deadlocking plan was accepted")


def test_microbatch_split_and_merge_match_torch():
    from torch.distributed.pipelining import microbatch as theirs

    x = torch.arange(30.0).reshape(10, 3)
    cases = [
        ((x, 5), {"m": x.t()}, None, {"m": TensorChunkSpec(1)}, 4),
        ((x,), {}, None, None, 3),
        ((x[:2], x), {}, None, None, 4),  # fewer chunks: the shortest tensor decides
        ((x,), {"y": x, "flag": True}, (TensorChunkSpec(1),), None, 2),
    ]
    for args, kwargs, aspec, kspec, chunks in cases:
        conv = (lambda s: None if s is None else type(s)(
            {k: theirs.TensorChunkSpec(v.split_dim) for k, v in s.items()} if isinstance(s, dict)
            else [theirs.TensorChunkSpec(v.split_dim) for v in s]))
        got = split_args_kwargs_into_chunks(args, kwargs, chunks, aspec, kspec)
        want = theirs.split_args_kwargs_into_chunks(args, kwargs, chunks, conv(aspec), conv(kspec))
        assert len(got[0]) == len(want[0]) and len(got[1]) == len(want[1])
        for g, w in zip(got[0] + got[1], want[0] + want[1]):
            flat_g, flat_w = torch.utils._pytree.tree_flatten(g)[0], torch.utils._pytree.tree_flatten(w)[0]
            for a, b in zip(flat_g, flat_w):
                assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
    plain = [(torch.ones(2, 3) * i, torch.zeros(i + 1, 3)) for i in range(3)]
    for a, b in zip(merge_chunks(plain, None), theirs.merge_chunks(plain, None)):
        torch.testing.assert_close(a, b)
    chunks = [(torch.ones(2, 3) * i, 7) for i in range(3)]
    spec = (TensorChunkSpec(1), "same")
    assert merge_chunks(chunks, spec)[0].shape == (2, 9) and merge_chunks(chunks, spec)[1] == 7
    assert str(TensorChunkSpec(1)) == str(theirs.TensorChunkSpec(1))
    assert [s.split_dim for s in TensorChunkSpec.from_tuple((0, 1))] == [0, 1]


def _check_dualpipe_v_plan(pp: int, m: int) -> None:
    """Every (stage, microbatch) gets one F and one B or an I then a W; the ranks run the plans together."""
    vee = _plans.stage_to_rank(pp, 2 * pp, "v")
    plans = {r: _plans.dualpipe_v(r, pp, m) for r in range(pp)}
    for r, plan in plans.items():
        flat = [a.key for a in _plans.compute_actions(plan)]
        assert len(flat) == len(set(flat)), (pp, m, r)
        for s in (r, 2 * pp - 1 - r):
            for mb in range(m):
                kinds = "".join(str(k) for st, k, x in flat if (st, x) == (s, mb))
                assert kinds in ("FB", "FIW"), (pp, m, r, s, mb, kinds)
    _plans.simulate(plans, vee, 2 * pp)


def test_dualpipe_v_plan_is_torchs_order_and_runs_without_deadlock():
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV as Theirs

    for pp in range(1, 6):
        for m in range(2 * pp, 2 * pp + 7):
            _check_dualpipe_v_plan(pp, m)
            fake = type("Fake", (), {"pp_group_size": pp, "_n_microbatches": m})()  # the method reads only these
            for r in range(pp):
                want = [repr(a) for a in Theirs._calculate_single_rank_operations(fake, r)]
                assert [repr(a) for a in _plans.dualpipe_v(r, pp, m)] == want, (pp, m, r)
    # two ranks, four microbatches, written out: stages 0 and 3 on rank 0, 1 and 2 on rank 1
    assert " ".join(map(repr, _plans.dualpipe_v(0, 2, 4))) == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1)OVERLAP_F_B (3F2;0B0)OVERLAP_F_B 3B2 (3F3;0B1)OVERLAP_F_B 3B3 0I2 "
        "0W2 0I3 0W3")
    assert " ".join(map(repr, _plans.dualpipe_v(1, 2, 4))) == (
        "1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0)OVERLAP_F_B (1F3;2B1)OVERLAP_F_B (2F3;1B1)OVERLAP_F_B 2B2 1B2 2I3 1I3 "
        "2W3 1W3")


def test_a_dualpipe_v_overlap_whose_backward_is_not_ready_deadlocks():
    vee = _plans.stage_to_rank(1, 2, "v")
    pair = (_plans._Action(0, _plans.F, 0), _plans._Action(1, _plans.B, 0))
    early = _plans._Action(-1, _plans.OVERLAP_F_B, None, pair)
    with pytest.raises(RuntimeError, match="deadlocks"):  # stage 1's F0 has not run: its B0 can never start
        _plans.simulate({0: [early]}, vee, 2)


# -- the tracer -------------------------------------------------------------------------------------------
class _Traced(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(4)])
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.head = nn.Linear(WIDTH, WIDTH)  # a top-level module after nested ones: stages keep the model's order

    def forward(self, x):
        skip = x * self.scale
        x = torch.tanh(self.layers[0](x))
        x = self.layers[1](x)
        x = self.layers[2](x) + skip  # skip crosses the split before layers.2
        return self.head(self.layers[3](torch.relu(x)))


class _Marked(_Traced):
    def forward(self, x):
        from torchdist.pipelining import pipe_split

        x = self.layers[1](torch.tanh(self.layers[0](x)))
        pipe_split()
        x = self.layers[2](x)
        pipe_split()
        return self.head(self.layers[3](x))


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch's own tracer deep-copies a LeafSpec
def test_tracer_splits_at_the_spec_and_at_pipe_split_like_torch():
    from torch.distributed.pipelining import SplitPoint as TorchSplitPoint
    from torch.distributed.pipelining import pipeline as torch_pipeline

    from torchdist.pipelining import SplitPoint, pipeline

    x = batch()[0][:2]
    model = _Traced()
    pipe = pipeline(model, (x,), split_spec={"layers.1": SplitPoint.BEGINNING, "layers.2": SplitPoint.BEGINNING})
    theirs = torch_pipeline(_Traced(), (x,), split_spec={"layers.1": TorchSplitPoint.BEGINNING,
                                                         "layers.2": TorchSplitPoint.BEGINNING})
    assert pipe.num_stages == theirs.num_stages == 3
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
    for i in range(3):
        mine = [n for n, _ in pipe.get_stage_module(i).named_parameters()]  # the model's order, as torch keeps it
        assert mine == [n for n, _ in theirs.get_stage_module(i).named_parameters()], i
        for n, p in pipe.get_stage_module(i).named_parameters():  # shared with the model, not copied
            assert p is model.get_parameter(n)
    marked = pipeline(_Marked(), (x,))
    assert marked.num_stages == 3
    end = pipeline(_Traced(), (x,), split_spec={"layers.0": SplitPoint.END})
    assert end.num_stages == 2 and {n for n, _ in end.get_stage_module(0).named_parameters()} == {
        "scale", "layers.0.weight", "layers.0.bias"}


def _body_traced(rank, world_size):
    from torchdist.pipelining import ScheduleGPipe, SplitPoint, pipeline

    x, y = batch()
    pipe = pipeline(_Traced(), (x[:2],), split_spec={"layers.2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, 4, loss_fn=F.mse_loss)
    losses = []
    for _ in range(2):  # the second step reuses what the first set up
        stage.submod.zero_grad()
        out = schedule.step(target=y, losses=losses) if rank == 1 else schedule.step(x)
    grads = {n: p.grad for n, p in stage.submod.named_parameters()}
    return grads, losses, out


def test_traced_pipeline_trains_like_the_model():
    results = run_ranks(_body_traced, 2, backend="gloo", timeout=60)
    model = _Traced()
    x, y = batch()
    for xm, ym in zip(x.tensor_split(4), y.tensor_split(4)):
        (F.mse_loss(model(xm), ym) / 4).backward()
    grads = {**results[0][0], **results[1][0]}
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
    assert len(results[1][1]) == 4 and results[0][2] is None
    torch.testing.assert_close(results[1][2], model(x))


# -- misuse -----------------------------------------------------------------------------------------------
def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        return (type(exc).__name__, str(exc))


def _body_construction_errors(rank, world_size, lib):
    dist, pp = libs(lib)
    lin = nn.Linear(WIDTH, WIDTH)
    stage = pp.PipelineStage(lin, rank, 2, torch.device("cpu"))
    out = {
        "index": _outcome(lambda: pp.PipelineStage(lin, 2, 2, torch.device("cpu"))),
        "too_few_stages": _outcome(lambda: pp.PipelineStage(lin, 0, 1, torch.device("cpu"))),
        "1f1b_mbs": _outcome(lambda: pp.Schedule1F1B(stage, 1, loss_fn=F.mse_loss)),
        "zbv_count": _outcome(lambda: pp.ScheduleZBVZeroBubble([stage], 2)),
        "dualpipev_count": _outcome(lambda: pp.ScheduleDualPipeV([stage], 2)),
        "dualpipev_mbs": _outcome(lambda: pp.ScheduleDualPipeV(
            [pp.PipelineStage(nn.Linear(WIDTH, WIDTH), s, 4, torch.device("cpu")) for s in (rank, 3 - rank)], 3)),
        "name": _outcome(lambda: pp.schedules.get_schedule_class("nope")),
        "found": pp.schedules.get_schedule_class("interleaved1f1b").__name__,
        "found_dualpipev": pp.schedules.get_schedule_class("dualpipev").__name__,
    }
    x, y = batch()
    schedule = pp.ScheduleGPipe(stage, BATCH + 1, loss_fn=F.mse_loss)  # more microbatches than samples
    out["too_many_mbs"] = _outcome(lambda: schedule.step(x) if rank == 0 else schedule.step(target=y))
    with torch.no_grad():
        out["no_grad"] = _outcome(lambda: pp.ScheduleGPipe(stage, 2, loss_fn=F.mse_loss).step(x))
    if lib == "torch":
        dist.destroy_process_group()
    return out


def test_construction_and_step_errors_match_torch():
    got = run_ranks(_body_construction_errors, 2, args=("torchdist",), backend="gloo", timeout=60)
    want = run_ranks(_body_construction_errors, 2, args=("torch",), timeout=60)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for key in w:
            assert g[key][0] == w[key][0], f"rank {rank} {key}: torchdist {g[key]}, torch {w[key]}"
        assert g["index"] == w["index"] and g["1f1b_mbs"] == w["1f1b_mbs"] and g["no_grad"] == w["no_grad"]
        for key in ("dualpipev_count", "dualpipev_mbs", "name", "found_dualpipev"):
            assert g[key] == w[key], (key, g[key], w[key])
        assert g["too_many_mbs"][1].startswith(w["too_many_mbs"][1])


def _body_disagreement(rank, world_size, case):
    from torchdist.pipelining import PipelineStage, ScheduleGPipe

    x, y = batch()
    lin = nn.Linear(WIDTH, WIDTH)
    extra = {}
    n_mb = 2
    if case == "shape" and rank == 1:
        extra = dict(input_args=torch.zeros(BATCH // 2, WIDTH + 1))  # stage 0 sends WIDTH columns
    if case == "static_shape":
        example = torch.zeros(BATCH // 2, WIDTH + rank)
        extra = dict(input_args=example, output_args=torch.zeros(BATCH // 2, WIDTH))
    if case == "microbatches" and rank == 1:
        n_mb = 4
    schedule = ScheduleGPipe(PipelineStage(lin, rank, 2, torch.device("cpu"), **extra), n_mb, loss_fn=F.mse_loss)
    return _outcome(lambda: schedule.step(x) if rank == 0 else schedule.step(target=y))


def test_stages_that_disagree_raise_instead_of_hanging():
    for case, rank1_error, needle in [("shape", "PipeliningMetadataError", "shape mismatch"),
                                      ("static_shape", "PipeliningMetadataError", "shape mismatch"),
                                      ("microbatches", "RuntimeError", "disagrees about the pipeline")]:
        r0, r1 = run_ranks(_body_disagreement, 2, args=(case,), backend="gloo", timeout=60)
        assert r1[0] == rank1_error and needle in r1[1], (case, r1)
        # rank 0 learns of it as a failed receive that names its stage, not as a hang
        assert r0[0] == "DistBackendError" and "pipeline stage 0" in r0[1], (case, r0)


# -- _ScheduleForwardOnly: inference, compared with the model and with torch ------------------------------
def _body_forward_only(rank, world_size, lib):
    dist, pp = libs(lib)
    model = full_model(world_size)
    stage = pp.PipelineStage(model[rank], rank, world_size, torch.device("cpu"))
    schedule = pp.schedules._ScheduleForwardOnly(stage, 4)
    x, y = batch()
    with torch.no_grad():
        outputs = [schedule.step(*((x + k,) if rank == 0 else ())) for k in range(2)]
    errors = []
    for kwargs in (dict(target=y), dict(losses=[])):
        try:
            schedule.step(*((x,) if rank == 0 else ()), **kwargs)
        except RuntimeError as exc:
            errors.append(str(exc))
    if lib == "torch":
        dist.destroy_process_group()
    return outputs, errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_forward_only_schedule_matches_the_model_and_torch(world_size):
    got = run_ranks(_body_forward_only, world_size, args=("torchdist",), backend="gloo", timeout=90)
    want = run_ranks(_body_forward_only, world_size, args=("torch",), timeout=90)
    x, _ = batch()
    with torch.no_grad():
        expected = [full_model(world_size)(x + k) for k in range(2)]
    for rank, ((outputs, errors), (torch_outputs, torch_errors)) in enumerate(zip(got, want)):
        assert errors == torch_errors == ["Forward-only schedule does not support loss computation"] * 2
        if rank == world_size - 1:
            for out, theirs, model_out in zip(outputs, torch_outputs, expected):
                torch.testing.assert_close(out, model_out)
                torch.testing.assert_close(out, theirs)
        else:
            assert outputs == torch_outputs == [None, None]
