"""``torchdist.checkpoint.state_dict`` against ``torch.distributed.checkpoint.state_dict`` on plain modules.

The same model and optimizer are built twice from one seed; each library's
``get_*`` must give the same dict (keys, order, values), and ``set_*`` of a
trained state must leave the same model and optimizer (or raise the same
error). DDP-wrapped modules are checked in test_multirank.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint.state_dict as torch_sd
from torch import nn

import torchdist.checkpoint as dcp
import torchdist.checkpoint.state_dict as our_sd

from ._common import assert_same, outcome, quiet


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)
        self.register_buffer("scratch", torch.ones(1), persistent=False)  # not in a state_dict


def _build(optim: str = "adam"):
    torch.manual_seed(0)
    model = _Net()
    model.body[0].bias.requires_grad_(False)
    if optim == "adam":
        optimizers = torch.optim.Adam(model.parameters(), lr=0.1)
    else:  # two optimizers over two parameter groups each
        optimizers = [torch.optim.SGD([{"params": model.body.parameters()}, {"params": [model.head.weight],
                                                                              "lr": 0.5}], lr=0.1, momentum=0.9),
                      torch.optim.Adam([model.head.bias], lr=0.01)]
    return model, optimizers


def _train(model, optimizers):
    for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _tuples_as_lists(value):
    if isinstance(value, dict):
        return {k: _tuples_as_lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tuples_as_lists(v) for v in value]
    return value


OPTIONS = [{}, {"ignore_frozen_params": True}, {"ignore_frozen_params": True, "strict": False},
           {"flatten_optimizer_state_dict": True}, {"cpu_offload": True}, {"full_state_dict": True}]


def _forward(self, x):
    return self.head(self.body(x))


_Net.forward = _forward


@pytest.mark.parametrize("optim", ["adam", "two"])
def test_get_and_set_match_torch(optim):
    for options in OPTIONS:
        ours, theirs = _build(optim), _build(optim)
        # fresh optimizers: both libraries create the state with a zero step first
        assert_same(our_sd.get_state_dict(*ours, options=our_sd.StateDictOptions(**options)),
                    quiet(torch_sd.get_state_dict, *theirs, options=torch_sd.StateDictOptions(**options)))
        torch.manual_seed(1)
        _train(*theirs)
        trained = torch_sd.get_state_dict(*theirs, options=torch_sd.StateDictOptions(**options))
        into_ours, into_theirs = _build(optim), _build(optim)
        got = outcome(our_sd.set_state_dict, *into_ours, model_state_dict=trained[0], optim_state_dict=trained[1],
                      options=our_sd.StateDictOptions(**options))
        want = outcome(torch_sd.set_state_dict, *into_theirs, model_state_dict=trained[0],
                       optim_state_dict=trained[1], options=torch_sd.StateDictOptions(**options))
        assert got[0] == want[0] and str(got[1]) == str(want[1]), options
        got, want = our_sd.get_state_dict(*into_ours), quiet(torch_sd.get_state_dict, *into_theirs)
        if options.get("full_state_dict"):  # PyTorch's full-state load turns tuple hyperparameters into lists
            got, want = _tuples_as_lists(got), _tuples_as_lists(want)
        assert_same(got, want)


def test_model_only_helpers_and_submodules():
    ours, theirs = _build(), _build()
    assert_same(our_sd.get_model_state_dict(ours[0]), torch_sd.get_model_state_dict(theirs[0]))
    for keep in (True, False):
        options = {"keep_submodule_prefixes": keep}
        assert_same(quiet(our_sd.get_model_state_dict, ours[0], submodules={ours[0].body},
                          options=our_sd.StateDictOptions(**options)),
                    quiet(torch_sd.get_model_state_dict, theirs[0], submodules={theirs[0].body},
                          options=torch_sd.StateDictOptions(**options)))
    state = our_sd.get_model_state_dict(ours[0])
    state["unexpected"] = torch.zeros(1)
    del state["head.bias"]
    for lib, model in ((our_sd, ours[0]), (torch_sd, theirs[0])):
        result = lib.set_model_state_dict(model, state, options=lib.StateDictOptions(strict=False))
        assert (result.missing_keys, result.unexpected_keys) == (["head.bias"], ["unexpected"])


def test_optimizer_state_round_trips_through_a_checkpoint(ckpt_dir):
    """The flow of PyTorch's tutorial: get_state_dict -> dcp.save; later dcp.load -> set_state_dict."""
    model, optimizer = _build()
    torch.manual_seed(1)
    _train(model, optimizer)
    model_sd, optim_sd = our_sd.get_state_dict(model, optimizer)
    quiet(dcp.save, {"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir, no_dist=True)
    fresh_model, fresh_optimizer = _build()
    target = {"model": our_sd.get_model_state_dict(fresh_model),
              "optim": our_sd.get_optimizer_state_dict(fresh_model, fresh_optimizer)}
    quiet(dcp.load, target, checkpoint_id=ckpt_dir, no_dist=True)
    our_sd.set_state_dict(fresh_model, fresh_optimizer, model_state_dict=target["model"],
                          optim_state_dict=target["optim"])
    assert_same(our_sd.get_state_dict(fresh_model, fresh_optimizer), our_sd.get_state_dict(model, optimizer))
    torch.manual_seed(2)
    _train(model, optimizer)
    torch.manual_seed(2)
    _train(fresh_model, fresh_optimizer)  # the restored run continues exactly as the original
    assert_same(our_sd.get_model_state_dict(fresh_model), our_sd.get_model_state_dict(model))


def _load_into_meta_models(rank: int, world_size: int) -> list:
    """A full state dict (given on rank 0, broadcast) materializes a model built on the meta device, plain and
    under fully_shard, as PyTorch's set_model_state_dict does (it assigns instead of copying)."""
    from torchdist.fsdp import fully_shard

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    full = {k: v.clone() for k, v in reference.state_dict().items()}
    x = torch.ones(2, 4)
    seen = []
    for shard in (False, True):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
        if shard:
            fully_shard(model)
        options = our_sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        our_sd.set_model_state_dict(model, full if rank == 0 else {}, options=options)
        weight = model[0].weight
        seen.append((weight.device.type, (weight.to_local() if shard else weight).device.type,
                     torch.allclose(model(x), reference(x))))
    return seen


def test_full_state_dict_materializes_a_meta_model():
    from torchdist.testing import run_ranks

    assert run_ranks(_load_into_meta_models, 2, backend="gloo", timeout=60) == [[("cpu", "cpu", True)] * 2] * 2


def _fsdp1_resume_through_dcp(rank: int, world_size: int, path: str) -> list:
    """The DCP tutorial's loop on an FSDP1 model: get_state_dict -> save -> a fresh model and optimizer ->
    get_state_dict -> load -> set_state_dict; then one more step on both gives the same parameters."""
    from torchdist.fsdp import FullyShardedDataParallel as FSDP

    def build():
        torch.manual_seed(0)
        model = FSDP(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    def step(model, optim, scale):
        model(torch.ones(2, 4) * scale).sum().backward()
        optim.step()
        optim.zero_grad()

    model, optim = build()
    for scale in (1.0, 2.0):
        step(model, optim, scale + rank)
    model_sd, optim_sd = our_sd.get_state_dict(model, optim)
    keys = sorted(optim_sd["state"])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    fresh, fresh_optim = build()
    step(fresh, fresh_optim, 5.0)  # different states, overwritten by the load
    target_model, target_optim = our_sd.get_state_dict(fresh, fresh_optim)
    target = {"model": target_model, "optim": target_optim}
    dcp.load(target, checkpoint_id=path)
    our_sd.set_state_dict(fresh, fresh_optim, model_state_dict=target["model"], optim_state_dict=target["optim"])
    for m, o in ((model, optim), (fresh, fresh_optim)):
        step(m, o, 3.0 + rank)
    full = our_sd.StateDictOptions(full_state_dict=True)
    original, resumed = our_sd.get_model_state_dict(model, options=full), our_sd.get_model_state_dict(fresh,
                                                                                                      options=full)
    return [keys, all(torch.allclose(original[k], resumed[k]) for k in original)]


def test_fsdp1_model_and_optimizer_resume_through_a_checkpoint(ckpt_dir):
    from torchdist.testing import run_ranks

    results = run_ranks(_fsdp1_resume_through_dcp, 2, args=(str(ckpt_dir),), backend="gloo", timeout=60)
    names = ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert results == [[names, True]] * 2
