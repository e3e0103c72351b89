"""The action IR: parsing, checking, lowering to SEND/RECV, the CSV files, and ``_PipelineScheduleRuntime``.

The passes are pure functions, so they are compared with PyTorch's on many plans
in this process; what needs a pipeline group (dumping a built-in schedule,
training on a loaded CSV) runs under ``run_ranks``, a few cases per spawn.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.pipelining.schedules as theirs
import torch.nn.functional as F

from torchdist.pipelining import _actions, _executor, _plans
from torchdist.pipelining._plans import _Action
from torchdist.testing import run_ranks

from ._common import assert_matches_reference, batch, full_model, libs, train


def _torch_actions(schedule: dict) -> dict:
    """Our schedule as PyTorch's _Action objects (through the text form both share)."""
    return {r: [None if a is None else theirs._Action.from_str(repr(a)) for a in row] for r, row in schedule.items()}


def _text(schedule: dict) -> dict:
    return {r: [None if a is None else repr(a) for a in row] for r, row in schedule.items()}


# -- text ---------------------------------------------------------------------------------------------------------
def test_actions_parse_and_print_like_torch():
    texts = ["2F0", "0B12", "3I1", "1W0", "1SEND_F0", "0RECV_B3", "2SEND_B1", "4RECV_F7", "0UNSHARD", "3RESHARD",
             "1REDUCE_GRAD", "(0F3;3B1)OVERLAP_F_B", "  1F2 ", "10F10", "1F0x"]
    for text in texts:
        ours, want = _Action.from_str(text), theirs._Action.from_str(text)
        assert repr(ours) == repr(want) == str(ours), text
        assert _Action.from_str(repr(ours)) == ours
        assert ours.is_compute_op == want.is_compute_op
    assert _Action.from_str("") is None and _Action.from_str("  ") is None
    assert _Action.from_str("1SEND_F0") == _Action(1, _plans.SEND_F, 0)
    assert _Action.from_str("0UNSHARD") == _Action(0, _plans.UNSHARD, None)
    assert [k.value for k in _plans._ComputationType] == [k.value for k in theirs._ComputationType]
    for bad in ["F0", "1X0", "x", "1OVERLAP_F_B", "(0F0;1B0)FOO", "-1F0"]:
        with pytest.raises(RuntimeError) as want:
            theirs._Action.from_str(bad)
        with pytest.raises(RuntimeError) as got:
            _Action.from_str(bad)
        assert str(got.value) == str(want.value), bad
    with pytest.raises(RuntimeError, match="Invalid computation type Z"):
        _plans._ComputationType.from_str("Z")


# -- the passes, compared with PyTorch's on every built-in plan -----------------------------------------------------
def _plans_for(pp: int, m: int):
    """(name, {rank: plan}, stage -> rank, num_stages) of the built-in plans at ``pp`` ranks, ``m`` microbatches."""
    loop2, vee = _plans.stage_to_rank(pp, 2 * pp), _plans.stage_to_rank(pp, 2 * pp, "v")
    rounds = max(1, m // pp)
    if m % rounds == 0:
        yield "interleaved", {r: _plans.interleaved_1f1b(r, pp, 2, m, m // rounds) for r in range(pp)}, loop2
        yield "zero_bubble", _plans.zero_bubble(2 * pp, pp, m, loop2, lambda r: 2 * (m // rounds) + 1), loop2
    yield "looped_bfs", {r: _plans.looped_bfs(r, pp, 2, m) for r in range(pp)}, loop2
    yield "zbv", {r: _plans.zbv(r, pp, m) for r in range(pp)}, vee
    if m >= 2 * pp:
        yield "dualpipe_v", {r: _plans.dualpipe_v(r, pp, m) for r in range(pp)}, vee
    yield "gpipe", {r: _plans.gpipe(r, m) for r in range(pp)}, _plans.stage_to_rank(pp, pp)


def test_lowering_passes_match_torch_on_every_built_in_plan():
    for pp in range(1, 5):
        for m in range(1, 9):
            for name, plan, placement in _plans_for(pp, m):
                stages = len(placement)
                where = (name, pp, m)
                assert _actions.validate_schedule(plan, pp, stages, m) == theirs._validate_schedule(
                    _torch_actions(plan), pp, stages, m), where
                ours = {r: _actions.add_reduce_grad(_actions.add_unshard_reshard(row), m) for r, row in plan.items()}
                want = {r: theirs._add_reduce_grad(theirs._add_unshard_reshard(row), m)
                        for r, row in _torch_actions(plan).items()}
                assert _text(ours) == _text(want), where
                ours = _actions.add_send_recv(ours, placement.__getitem__, stages)
                want = theirs._add_send_recv(want, placement.__getitem__, stages)
                assert _text(ours) == _text(want), where
                # PyTorch's simulator knows only compute and SEND/RECV: lower the bare plan for it
                ours = _actions.add_send_recv(plan, placement.__getitem__, stages)
                want = theirs._add_send_recv(_torch_actions(plan), placement.__getitem__, stages)
                assert _text(ours) == _text(want), where
                simulated = _actions.simulate_comms_compute(ours, placement.__getitem__, stages)
                if name != "dualpipe_v":  # PyTorch's simulator fails on OVERLAP_F_B; ours runs both halves
                    assert _text(simulated) == _text(theirs._simulate_comms_compute(
                        want, placement.__getitem__, stages)), where
                for row in plan.values():
                    assert _text({0: _actions.merge_bw(list(row))}) == _text(
                        {0: theirs._merge_bw(_torch_actions({0: row})[0])}), where
            table = {r: [None] * r + row for r, row in plan.items()}  # idle slots print as blanks
            assert _actions.format_pipeline_order(table, 3) == theirs._format_pipeline_order(
                _torch_actions(table), 3)


def test_an_invalid_schedule_gets_torchs_error():
    f0, b0, f1, b1 = (_Action.from_str(t) for t in ("0F0", "0B0", "1F0", "1B0"))
    cases = [
        {0: [b0, f0], 1: [f1, b1]},  # backward before forward
        {0: [f0, b0], 1: [f1, b1, _Action.from_str("1W0")]},  # W without I
        {0: [f0, b0], 1: [f1, b1, _Action.from_str("0F1")]},  # stage 0 on two ranks
        {0: [f0, b0], 1: [f1]},  # a backward missing
        {0: [f0, _Action.from_str("0I0"), b0], 1: [f1, b1]},  # I without W
        {0: [f0, b0]},  # a rank missing
        {0: [f0, b0], 1: [b1]},  # a forward missing
    ]
    for case in cases:
        with pytest.raises(AssertionError) as want:
            theirs._validate_schedule(_torch_actions(case), 2, 2, 1)
        with pytest.raises(AssertionError) as got:
            _actions.validate_schedule(case, 2, 2, 1)
        assert str(got.value) == str(want.value)
    waits = {0: [b0, f0], 1: [f1, b1]}  # each rank's first action needs the other's second
    with pytest.raises(AssertionError, match="Malformed compute schedule, can't schedule sends/recvs"):
        theirs._add_send_recv(_torch_actions(waits), {0: 0, 1: 1}.__getitem__, 2)
    with pytest.raises(AssertionError, match="Malformed compute schedule, can't schedule sends/recvs"):
        _actions.add_send_recv(waits, {0: 0, 1: 1}.__getitem__, 2)


# -- with a pipeline group --------------------------------------------------------------------------------------------
def _stages(pp, dist, placement_style: str, num_stages: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    placement = _plans.stage_to_rank(world, num_stages, placement_style)
    model = full_model(num_stages)
    return [pp.PipelineStage(copy.deepcopy(model[s]), s, num_stages, torch.device("cpu"))
            for s in range(num_stages) if placement[s] == rank]


_DUMPS = {2: [("Interleaved1F1B", 4), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 4), ("LoopedBFS", 3),
              ("DualPipeV", 5)],
          3: [("Interleaved1F1B", 4), ("Interleaved1F1B", 6), ("ZBVZeroBubble", 4), ("ZBVZeroBubble", 6)]}


def _body_dump(rank, world_size, lib, out_dir):
    dist, pp = libs(lib)
    files = {}
    for name, n_mb in _DUMPS[world_size]:
        style = "v" if name in ("ZBVZeroBubble", "DualPipeV") else "loop"
        schedule = pp.schedules.get_schedule_class(name)(_stages(pp, dist, style, 2 * world_size), n_mb,
                                                         loss_fn=F.mse_loss)
        for fmt in ("compute_comms", "compute_only"):
            path = os.path.join(out_dir, f"{lib}-{rank}-{name}-{n_mb}-{fmt}.csv")
            schedule._dump_csv(path, format=fmt)
            with open(path) as f:
                files[name, n_mb, fmt] = f.read()
    if lib == "torch":
        dist.destroy_process_group()
    return files


@pytest.mark.parametrize("world_size", [2, 3])
def test_built_in_schedules_dump_the_csv_torch_dumps(world_size, tmp_path):
    got = run_ranks(_body_dump, world_size, args=("torchdist", str(tmp_path)), backend="gloo", timeout=60)
    want = run_ranks(_body_dump, world_size, args=("torch", str(tmp_path)), timeout=60)
    for key in want[0]:
        name, n_mb, fmt = key
        if fmt == "compute_only" and name != "DualPipeV":
            # PyTorch pads these plans with idle slots (blank cells) to line the ranks up in time; ours has
            # none. The actions, and so the lowered schedule, are the same.
            strip = [[c for c in line.split(",") if c] for line in want[0][key].splitlines()]
            assert [line.split(",") for line in got[0][key].splitlines()] == strip, key
        else:
            assert got[0][key] == want[0][key], key
    assert all(g == got[0] for g in got)


def _body_train_csv(rank, world_size, lib, runs):
    """Per run: train a loaded CSV with _PipelineScheduleRuntime (or PipelineScheduleMulti) and the built-in
    schedule named; return both results."""
    dist, pp = libs(lib)
    out = []
    for path, fmt, cls_name, style, num_stages, n_mb, builtin in runs:
        stages = _stages(pp, dist, style, num_stages)
        cls = getattr(pp.schedules, cls_name)
        schedule = cls(stages, n_mb, loss_fn=F.mse_loss)
        schedule._load_csv(path, format=fmt) if fmt else schedule._load_csv(path)
        x, y = batch()
        losses = []
        mine = {s.stage_index for s in stages}
        kwargs = dict(target=y, losses=losses) if num_stages - 1 in mine else {}
        output = schedule.step(*((x,) if 0 in mine else ()), **kwargs)
        grads = {f"{s.stage_index}.{n}": p.grad.clone() for s in stages for n, p in s.submod.named_parameters()}
        loaded = {"losses": [loss.detach() for loss in losses], "grads": grads,
                  "output": None if output is None else output.detach()}
        out.append((loaded, train(pp, dist, builtin, num_stages, n_mb) if builtin else None))
    if lib == "torch":
        dist.destroy_process_group()
    return out


def _assert_same(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["grads"].keys() == y["grads"].keys()
        for key in x["grads"]:
            torch.testing.assert_close(x["grads"][key], y["grads"][key], msg=key)
        for p, q in zip(x["losses"], y["losses"], strict=True):
            torch.testing.assert_close(p, q)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_csv_torch_wrote_trains_in_torchdist_like_the_model(world_size, tmp_path):
    # torch writes the schedules: Interleaved1F1B compute only (blank idle cells) and with comms, ZBV with comms
    run_ranks(_body_dump, world_size, args=("torch", str(tmp_path)), timeout=60)
    inter = _DUMPS[world_size][0][1]
    zbv = [n for name, n in _DUMPS[world_size] if name == "ZBVZeroBubble"][0]

    def path(name, n_mb, fmt):
        return str(tmp_path / f"torch-0-{name}-{n_mb}-{fmt}.csv")

    ns = 2 * world_size
    runs = [
        (path("Interleaved1F1B", inter, "compute_only"), "compute_only", "_PipelineScheduleRuntime", "loop", ns,
         inter, "Interleaved1F1B"),
        (path("Interleaved1F1B", inter, "compute_comms"), "compute_comms", "_PipelineScheduleRuntime", "loop", ns,
         inter, None),
        (path("Interleaved1F1B", inter, "compute_only"), None, "PipelineScheduleMulti", "loop", ns, inter, None),
        (path("ZBVZeroBubble", zbv, "compute_comms"), "compute_comms", "_PipelineScheduleRuntime", "v", ns, zbv,
         "ZBVZeroBubble"),
        (path("ZBVZeroBubble", zbv, "compute_only"), "compute_only", "_PipelineScheduleRuntime", "v", ns, zbv, None),
    ]
    got = run_ranks(_body_train_csv, world_size, args=("torchdist", runs), backend="gloo", timeout=90)
    for i, (*_, num_stages, n_mb, builtin) in enumerate(runs):
        assert_matches_reference([r[i][0] for r in got], num_stages, n_mb)
        if builtin:
            _assert_same([r[i][0] for r in got], [r[i][1] for r in got])
    if world_size == 2:  # torch on the same files gives the same numbers
        want = run_ranks(_body_train_csv, world_size, args=("torch", runs[:2]), timeout=90)
        for i in range(2):
            _assert_same([r[i][0] for r in got], [r[i][0] for r in want])


_CUSTOM = {
    # one stage per rank, 1F1B written by hand (compute only)
    "custom.csv": "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n",
    # the same with its communication written out, the FSDP actions (no-ops on a plain module), and rank 1's first
    # backward split into I and W
    "custom_comms.csv": ("0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0REDUCE_GRAD,0RESHARD\n"
                         "1RECV_F0,1F0,1I0,1SEND_B0,1W0,1RECV_F1,1F1,1B1,1SEND_B1,1REDUCE_GRAD\n"),
    # stage 0's backward of microbatch 1 before its forward
    "invalid.csv": "0F0,0B1,0F1,0B0\n1F0,1B0,1F1,1B1\n",
}


def _body_custom(rank, world_size, out_dir):
    dist, pp = libs("torchdist")
    runs = [("custom.csv", "compute_only"), ("custom_comms.csv", "compute_comms")]
    results = _body_train_csv(rank, world_size, "torchdist",
                              [(os.path.join(out_dir, f), fmt, "_PipelineScheduleRuntime", "loop", 2, 2, None)
                               for f, fmt in runs])
    # the same plan handed over as a dict instead of a file
    stages = _stages(pp, dist, "loop", 2)
    schedule = pp.schedules._PipelineScheduleRuntime(stages, 2, loss_fn=F.mse_loss)
    with open(os.path.join(out_dir, "custom.csv")) as f:
        schedule._load_actions({r: [_Action.from_str(c) for c in line.split(",")] for r, line in enumerate(f)})
    x, y = batch()
    schedule.step(*((x,) if rank == 0 else ()), **(dict(target=y) if rank == 1 else {}))
    for st in stages:
        for n, p in st.submod.named_parameters():
            torch.testing.assert_close(p.grad, results[0][0]["grads"][f"{st.stage_index}.{n}"])
    empty = pp.schedules._PipelineScheduleRuntime(_stages(pp, dist, "loop", 2), 2, loss_fn=F.mse_loss)
    try:
        empty.step(*((x,) if rank == 0 else ()), **(dict(target=y) if rank == 1 else {}))
    except RuntimeError as exc:
        assert "load one with _load_csv or _load_actions" in str(exc)
    else:
        raise AssertionError("a schedule without actions ran")
    schedule = pp.schedules._PipelineScheduleRuntime(_stages(pp, dist, "loop", 2), 2, loss_fn=F.mse_loss)
    try:
        schedule._load_csv(os.path.join(out_dir, "invalid.csv"))
    except AssertionError as exc:
        error = str(exc)
    else:
        error = None
    return [r[0] for r in results], error


def test_a_hand_written_schedule_runs_and_an_invalid_one_gets_torchs_error(tmp_path):
    for name, text in _CUSTOM.items():
        (tmp_path / name).write_text(text)
    got = run_ranks(_body_custom, 2, args=(str(tmp_path),), backend="gloo", timeout=60)
    for i in range(2):
        assert_matches_reference([r[0][i] for r in got], 2, 2)
    invalid = {r: [theirs._Action.from_str(c) for c in line.split(",")]
               for r, line in enumerate(_CUSTOM["invalid.csv"].splitlines())}
    with pytest.raises(AssertionError) as want:
        theirs._validate_schedule(invalid, 2, 2, 2)
    assert got[0][1] == got[1][1] == str(want.value)
    assert "Running Full Backward for stage 0, microbatch 1 without first running Forward" in got[0][1]



def _body_fsdp_stages(rank, world_size):
    from torchdist.fsdp import fully_shard

    dist, pp = libs("torchdist")
    model = full_model(2)
    stages = []
    for s in range(2):
        module = copy.deepcopy(model[s])
        fully_shard(module)
        stages.append(pp.PipelineStage(module, s, 2, torch.device("cpu")))
    assert _executor._fsdp_modules(stages[0]) == [stages[0].submod]  # UNSHARD/RESHARD will reach it
    schedule = pp.ScheduleInterleaved1F1B(stages, 2, loss_fn=F.mse_loss)
    x, y = batch()
    losses = []
    output = schedule.step(x, target=y, losses=losses)
    grads = {f"{s.stage_index}.{n}": (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for s in stages for n, p in s.submod.named_parameters()}
    return {"losses": [loss.detach() for loss in losses], "grads": grads, "output": output.detach(),
            "plan": [repr(a) for a in schedule.pipeline_order_with_comms[0]]}


def test_unshard_and_reshard_act_on_fsdp_stages():
    (got,) = run_ranks(_body_fsdp_stages, 1, backend="gloo", timeout=60)
    assert got["plan"][:2] == ["0UNSHARD", "1UNSHARD"] and got["plan"][-1] == "0RESHARD"
    assert_matches_reference([got], 2, 2)
