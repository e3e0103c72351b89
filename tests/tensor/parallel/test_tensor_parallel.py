"""Tensor parallelism against the unparallelized module and against torch.distributed.tensor.parallel (gloo).

One body per (library, world size) trains an MLP (colwise then rowwise) and a transformer-like block under
several plans for a few optimizer steps and records losses, outputs, gradients and parameters as whole tensors.
Each rank checks them against the same module run without parallelism in its own process; the test then checks
that torchdist's records match torch's.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchdist.testing import run_ranks

from .._common import Lib, _close, observe
from ._models import MLP, Block

STEPS = 3


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "placements") else t


def _block_plan(tp, sequence_parallel: bool) -> dict:
    """The Megatron plan of :class:`Block`; with ``sequence_parallel`` norms and residuals run sequence-sharded."""
    Colwise, Rowwise, R, S = tp.ColwiseParallel, tp.RowwiseParallel, tp.Replicate, tp.Shard
    if not sequence_parallel:
        return {
            "tok": Rowwise(input_layouts=R()),
            "attn.w[qkv]": Colwise(),  # fnmatch pattern: wq, wk, wv
            "attn.wo": Rowwise(),
            "mlp.w1": Colwise(),
            "mlp.w2": Rowwise(),
            "out": Colwise(use_local_output=False),
        }
    return {
        "tok": Rowwise(input_layouts=R(), output_layouts=S(1)),
        "norm*": tp.SequenceParallel(),
        "attn": tp.PrepareModuleInput(input_layouts=(S(1),), desired_input_layouts=(R(),)),
        "attn.wq": Colwise(), "attn.wk": Colwise(), "attn.wv": Colwise(),
        "attn.wo": Rowwise(output_layouts=S(1)),
        "mlp": tp.PrepareModuleInput(input_layouts=(S(1),), desired_input_layouts=(R(),)),
        "mlp.w1": Colwise(),
        "mlp.w2": Rowwise(output_layouts=S(1)),
        "out": Colwise(input_layouts=S(1), use_local_output=False),
    }


def _train(model: nn.Module, reference: nn.Module, inputs, loss_fn, opt_cls, tp_loss_ctx, record: dict, key: str,
           problems: list, rank: int) -> None:
    """Train both models STEPS steps on the same data; record and check the parallel one against the reference."""
    opt = opt_cls(model.parameters())
    ref_opt = opt_cls(reference.parameters())
    for step in range(STEPS):
        with tp_loss_ctx():
            out = model(inputs)
            loss = loss_fn(out)
            loss.backward()
        ref_out = reference(inputs)
        ref_loss = loss_fn(ref_out)
        ref_loss.backward()
        got = {"loss": _whole(loss), "out": _whole(out)}
        got.update({f"grad {n}": _whole(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        got.update({f"param {n}": _whole(p.detach()) for n, p in model.named_parameters()})
        want = {"loss": ref_loss, "out": ref_out}
        want.update({f"grad {n}": p.grad for n, p in reference.named_parameters()})
        ref_opt.step()
        ref_opt.zero_grad()
        want.update({f"param {n}": p.detach() for n, p in reference.named_parameters()})
        for name, value in got.items():
            if not torch.allclose(value, want[name], rtol=1e-4, atol=1e-5):
                problems.append(f"rank {rank} {key} step {step} {name}: max diff "
                                f"{(value - want[name]).abs().max().item():.3g}")
            record[f"{key} step {step} {name}"] = value.tolist()


def _body(rank: int, world: int, lib_name: str) -> dict:
    lib = Lib(lib_name, (world,))
    tp = importlib.import_module(lib.T.__name__ + ".parallel")
    tp.Replicate, tp.Shard = lib.R, lib.S
    mesh = lib.mesh
    record: dict = {}
    problems: list[str] = []

    # 1. MLP: colwise then rowwise, 3-d input, SGD with momentum. Hidden 24: even shards at 1-4 ranks (a local
    # tensor handed from colwise to rowwise is taken as an even shard, in PyTorch too).
    torch.manual_seed(0)
    mlp = MLP(8, 24)
    reference = copy.deepcopy(mlp)
    x = torch.randn(4, 3, 8)
    tp.parallelize_module(mlp, mesh, {"w1": tp.ColwiseParallel(), "w2": tp.RowwiseParallel()})
    _train(mlp, reference, x, lambda out: out.pow(2).mean(), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
           contextlib.nullcontext, record, "mlp", problems, rank)
    mlp(x).sum().backward()
    record["mlp placements"] = _placements(mlp)

    # 2. The block under the two plans, cross-entropy through loss_parallel, AdamW.
    tokens = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(2))

    def ce(logits):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))

    for sequence_parallel in (False, True):
        torch.manual_seed(3)
        block = Block()
        reference = copy.deepcopy(block)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchdist warns where an op falls back to replication
            tp.parallelize_module(block, mesh, _block_plan(tp, sequence_parallel))
            _train(block, reference, tokens, ce, lambda ps: torch.optim.AdamW(ps, lr=0.01), tp.loss_parallel, record,
                   f"block sp={sequence_parallel}", problems, rank)
            with tp.loss_parallel():
                ce(block(tokens)).backward()
        record[f"block sp={sequence_parallel} placements"] = _placements(block)
    _styles_and_errors(lib, tp, mesh, record)
    _loss_variants(lib, tp, mesh, record, problems, rank)
    if world == 4:
        _two_dim_mesh(lib, tp, record, problems, rank)
    lib.close()
    return {"record": record, "problems": problems}


def _placements(model: nn.Module) -> dict:
    """Each parameter's placements and its gradient's (None where a plain tensor)."""
    def of(t):
        return [str(p) for p in t.placements] if hasattr(t, "placements") else None
    return {n: (of(prm), of(prm.grad) if prm.grad is not None else None) for n, prm in model.named_parameters()}


class _TwoOut(nn.Module):
    def forward(self, x, y=None, *, scale=None):
        return x * 2, (y if y is not None else x) + (scale if scale is not None else 0)


def _styles_and_errors(lib, tp, mesh, record: dict) -> None:
    """Reprs, warnings and errors of the public API, and the PrepareModule* conversions."""
    R, S = lib.R, lib.S
    for style in (tp.ColwiseParallel(), tp.RowwiseParallel(input_layouts=R(), output_layouts=S(1)),
                  tp.SequenceParallel(sequence_dim=0), tp.PrepareModuleOutput(output_layouts=R(),
                                                                                desired_output_layouts=R()),
                  tp.PrepareModuleInput(input_layouts=(S(0), None), desired_input_layouts=(R(), None)),
                  tp.PrepareModuleInputOutput(input_layouts=S(0), desired_input_layouts=R(),
                                              output_layouts=R(), desired_output_layouts=R())):
        record[f"repr {type(style).__name__}"] = repr(style)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        linear = nn.Linear(4, 4)
        record["no plan returns module"] = tp.parallelize_module(linear, mesh) is linear
        record["unmatched key returns module"] = tp.parallelize_module(linear, mesh, {"nope": tp.ColwiseParallel()}) \
            is linear
    record["warnings"] = [str(w.message).splitlines()[0][:60] for w in caught]
    record["bad plan"] = observe(lambda: tp.parallelize_module(nn.Linear(4, 4), mesh, [tp.ColwiseParallel()]))
    record["conv colwise"] = observe(lambda: tp.parallelize_module(nn.Conv1d(2, 2, 1), mesh, tp.ColwiseParallel()),
                                     message=False)
    record["conv rowwise"] = observe(lambda: tp.parallelize_module(nn.Conv1d(2, 2, 1), mesh, tp.RowwiseParallel()),
                                     message=False)
    record["uneven layouts"] = observe(lambda: tp.PrepareModuleInput(input_layouts=(R(), R()),
                                                                     desired_input_layouts=(R(),)))
    record["missing desired"] = observe(lambda: tp.PrepareModuleInput(input_layouts=R()))
    record["uneven outputs"] = observe(lambda: tp.PrepareModuleOutput(output_layouts=(R(), R()),
                                                                      desired_output_layouts=R()))
    # PrepareModuleInput with keyword inputs, PrepareModuleOutput on a tuple output; plain tensors are local blocks.
    world = mesh.size()
    x = torch.arange(4.0 * world).view(2 * world, 2)[2 * mesh.get_local_rank():][:2]  # this rank's rows
    module = _TwoOut()
    tp.parallelize_module(module, mesh, tp.PrepareModuleInputOutput(
        input_layouts=(S(0), None), desired_input_layouts=(R(), None), input_kwarg_layouts={"scale": R()},
        desired_input_kwarg_layouts={"scale": R()}, output_layouts=(R(), None), desired_output_layouts=(R(), None),
        use_local_output=False))
    record["prepare in/out"] = observe(lambda: module(x, torch.ones(1), scale=torch.ones(2)))
    module = _TwoOut()
    tp.parallelize_module(module, mesh, {"": tp.PrepareModuleInput(input_layouts=S(0), desired_input_layouts=S(1),
                                                                   use_local_output=True)})
    record["prepare input local"] = observe(lambda: module(x))
    module = _TwoOut()
    tp.parallelize_module(module, mesh, tp.PrepareModuleOutput(output_layouts=(S(0), S(0)),
                                                               desired_output_layouts=(R(), S(1))))
    record["prepare output"] = observe(lambda: module(x))
    record["prepare output count"] = observe(lambda: tp.parallelize_module(
        _TwoOut(), mesh, tp.PrepareModuleOutput(output_layouts=R(), desired_output_layouts=R()))(x))


def _loss_variants(lib, tp, mesh, record: dict, problems: list, rank: int) -> None:
    """cross_entropy under loss_parallel: reductions, class weights, ignore_index, 4-d logits, against local torch."""
    T, R, S = lib.T, lib.R, lib.S
    gen = torch.Generator().manual_seed(5)
    cases = [("2d", torch.randn(6, 7, generator=gen), torch.tensor([0, 6, 3, -100, 2, 5]), {}),
             ("4d", torch.randn(2, 7, 3, 2, generator=gen), torch.randint(0, 7, (2, 3, 2), generator=gen), {}),
             ("1d", torch.randn(7, generator=gen), torch.tensor(4), {})]
    weight = torch.rand(7, generator=gen)
    for name, logits, target, _ in cases:
        for reduction in ("mean", "sum", "none"):
            for w in (None, weight):
                key = f"loss {name} {reduction} weight={w is not None}"
                if w is not None and lib.name == "torch" and (target == -100).any():
                    continue  # PyTorch's loss_parallel backward fails on weight with ignored targets (gathers -100)
                leaf = logits.clone().requires_grad_(True)
                dlogits = T.distribute_tensor(leaf, mesh, [S(1 if logits.ndim > 1 else 0)])
                with tp.loss_parallel():
                    loss = F.cross_entropy(dlogits, target, weight=w, reduction=reduction)
                    (loss.sum() if reduction == "none" else loss).backward()
                ref_leaf = logits.clone().requires_grad_(True)
                ref = F.cross_entropy(ref_leaf, target, weight=w, reduction=reduction)
                (ref.sum() if reduction == "none" else ref).backward()
                value, grad = _whole(loss), dlogits.grad
                # PyTorch's loss_parallel puts the -1 of 4-d logits' gradient at the wrong places: torchdist's
                # gradient is checked against the reference only.
                torch_bug = lib.name == "torch" and logits.ndim > 2
                if not (torch.allclose(value, ref, rtol=1e-5, atol=1e-6)
                        and (torch_bug or torch.allclose(_whole(grad), ref_leaf.grad, rtol=1e-5, atol=1e-6))):
                    problems.append(f"rank {rank} {key}: loss {value} vs {ref}, grad max diff "
                                    f"{(_whole(grad) - ref_leaf.grad).abs().max()}")
                if lib.name == "torch" or not (w is not None and (target == -100).any()):
                    record[key] = observe(lambda: (loss, grad) if logits.ndim <= 2 else loss)
    replicated = T.distribute_tensor(torch.randn(4, 7), mesh, [R()])
    sharded = T.distribute_tensor(torch.randn(3, 7, generator=gen), mesh, [S(1)])
    zeros = torch.zeros(4, dtype=torch.long)
    with tp.loss_parallel():
        record["loss replicated logits"] = observe(lambda: F.cross_entropy(replicated, zeros), message=False)
        record["loss log_softmax"] = observe(lambda: sharded.log_softmax(1))


def _two_dim_mesh(lib, tp, record: dict, problems: list, rank: int) -> None:
    """TP inside (2 ranks) and plain data parallel outside (2 groups): gradients averaged over "dp" by hand."""
    init_device_mesh = importlib.import_module(lib.c10d.__name__ + ".device_mesh").init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    torch.manual_seed(7)
    mlp = MLP(8, 24)
    reference = copy.deepcopy(mlp)
    x = torch.randn(8, 3, 8)
    tp.parallelize_module(mlp, mesh["tp"], {"w1": tp.ColwiseParallel(), "w2": tp.RowwiseParallel()})
    opt, ref_opt = torch.optim.SGD(mlp.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        mlp(x[4 * dp_rank:4 * dp_rank + 4]).pow(2).mean().backward()
        for p in mlp.parameters():
            lib.c10d.all_reduce(p.grad._local_tensor, group=mesh.get_group("dp"))
            p.grad._local_tensor.div_(2)
        opt.step()
        opt.zero_grad()
        reference(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for (n, p), q in zip(mlp.named_parameters(), reference.parameters()):
            if not torch.allclose(p.full_tensor(), q, rtol=1e-4, atol=1e-5):
                problems.append(f"rank {rank} 2-d mesh step {step} {n}")
            record[f"2d step {step} {n}"] = p.full_tensor().tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_training_matches_reference_and_torch(world: int) -> None:
    got = run_ranks(_body, world, args=("torchdist",), timeout=120)
    want = run_ranks(_body, world, args=("torch",), timeout=120)
    for rank in range(world):
        assert not want[rank]["problems"], want[rank]["problems"][:5]  # the test's own premise, on torch
        assert not got[rank]["problems"], got[rank]["problems"][:8]
        g, w = got[rank]["record"], want[rank]["record"]
        assert g.keys() == w.keys()
        bad = [key for key in w if not _close(g[key], w[key])]
        assert not bad, f"world {world} rank {rank}: differs from torch in " + \
            "\n".join(f"{key}:\n  torchdist {g[key]!r:.300}\n  torch     {w[key]!r:.300}" for key in bad[:6])
