"""A small model, its pipelined training on either library, and its non-pipelined reference."""

from __future__ import annotations

import copy
import importlib

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, BATCH = 6, 8


def block(i: int) -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) if i % 2 == 0 else nn.Sequential(nn.Linear(WIDTH, WIDTH))


def full_model(num_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[block(i) for i in range(num_stages)])


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def libs(lib: str):
    """(c10d module, pipelining module) of ``lib``; torch's gloo group is made here."""
    if lib == "torch":
        import torch.distributed as tdist

        if not tdist.is_initialized():
            tdist.init_process_group("gloo")
        return tdist, importlib.import_module("torch.distributed.pipelining")
    import torchdist

    return torchdist, importlib.import_module("torchdist.pipelining")


def reference(num_stages: int, n_mb: int, steps: int = 1) -> dict:
    """Losses per microbatch and gradients of the unsplit model, trained the same way (grads of the last step)."""
    model = full_model(num_stages)
    x, y = batch()
    losses = []
    for _ in range(steps):
        model.zero_grad()
        output = model(x).detach()
        losses = []
        for xm, ym in zip(x.tensor_split(n_mb), y.tensor_split(n_mb)):
            loss = F.mse_loss(model(xm), ym)
            (loss / n_mb).backward()
            losses.append(loss.detach())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return {"losses": losses, "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "output": output}


def train(pp, dist, schedule_name: str, num_stages: int, n_mb: int, steps: int = 1, static: bool = False,
          group=None, evaluate: bool = False) -> dict:
    """Train ``full_model(num_stages)`` pipelined with ``schedule_name``; this rank's losses, grads and output
    (and, with ``evaluate``, the output of an ``eval()`` run before training: forwards only)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cls = pp.schedules.get_schedule_class(schedule_name)
    multi = num_stages > world
    if schedule_name in ("ZBVZeroBubble", "DualPipeV"):  # V placement: rank r holds stages r and 2P - 1 - r
        mine = [rank, 2 * world - 1 - rank]
    else:
        mine = [s for s in range(num_stages) if s % world == rank]
    model = full_model(num_stages)
    x, y = batch()
    stages = []
    for s in mine:
        module = copy.deepcopy(model[s])
        extra = {}
        if static:
            example = torch.zeros(BATCH // n_mb, WIDTH, requires_grad=s > 0)
            extra = dict(input_args=example, output_args=module(example))
        stages.append(pp.PipelineStage(module, s, num_stages, torch.device("cpu"), group=group, **extra))
    schedule = cls(stages if multi else stages[0], n_mb, loss_fn=F.mse_loss)
    args = (x,) if 0 in mine else ()
    evaluated = None
    if evaluate:
        evaluated = schedule.eval(*args, **(dict(target=y) if num_stages - 1 in mine else {}))
    out, losses = None, []
    for _ in range(steps):
        for st in stages:
            st.submod.zero_grad()
        kwargs = dict(target=y, losses=losses) if num_stages - 1 in mine else {}
        out = schedule.step(*args, **kwargs)
        with torch.no_grad():
            for st in stages:
                for p in st.submod.parameters():
                    p -= 0.1 * p.grad
    grads = {f"{s.stage_index}.{n}": p.grad.clone() for s in stages for n, p in s.submod.named_parameters()}
    return {"losses": [loss.detach() for loss in losses], "grads": grads,
            "output": None if out is None else out.detach(), "eval": evaluated}


def assert_matches_reference(results: list[dict], num_stages: int, n_mb: int, steps: int = 1) -> None:
    """Grads, losses and the merged output of the last step equal the unsplit model's."""
    want = reference(num_stages, n_mb, steps)
    grads = {}
    for r in results:
        grads.update(r["grads"])
    assert set(grads) == set(want["grads"]), (sorted(grads), sorted(want["grads"]))
    for name, g in want["grads"].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    last = [r for r in results if r["losses"]]
    assert len(last) == 1
    torch.testing.assert_close(torch.stack(last[0]["losses"]), torch.stack(want["losses"]))
    torch.testing.assert_close(last[0]["output"], want["output"], rtol=1e-5, atol=1e-6)
