"""Unused parameters, static graph, and the errors PyTorch gives for them (inventory 70-72)."""

from __future__ import annotations

import types
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from torchdist._ddp.reducer import reached_leaves
from torchdist.nn.parallel import DistributedDataParallel as DDP
from torchdist.testing import run_ranks

from ._common import TOL


class TwoBranch(nn.Module):
    """``net2`` is used only when ``use_net2``; ``never`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(4, 4)
        self.net2 = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)

    def forward(self, x, use_net2=True):
        x = self.net1(x)
        return self.net2(x) if use_net2 else x


def _unused(rank, world_size):
    torch.manual_seed(0)
    ddp = DDP(TwoBranch(), find_unused_parameters=True)
    x = torch.full((2, 4), float(rank + 1))
    ddp(x, use_net2=(rank == 0)).sum().backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in ddp.module.named_parameters()}
    ddp(x, use_net2=(rank == 0)).sum().backward()  # a second iteration works too
    return grads


def _all_used(rank, world_size):
    import warnings

    ddp = DDP(nn.Linear(4, 4), find_unused_parameters=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ddp(torch.ones(2, 4)).sum().backward()
    return [str(w.message)[:60] for w in caught if "find_unused_parameters" in str(w.message)]


def test_find_unused_parameters_that_finds_none_warns_once_as_pytorch():
    expected = ["find_unused_parameters=True was specified in DDP constructor"]
    assert run_ranks(_all_used, 2, backend="gloo") == [expected, expected]


def test_find_unused_parameters_averages_partially_used_and_leaves_unused_none():
    results = run_ranks(_unused, 2, backend="gloo")
    torch.manual_seed(0)
    model = TwoBranch()
    (model(torch.full((2, 4), 1.0)).sum() + model(torch.full((2, 4), 2.0), use_net2=False).sum()).backward()
    for rank, grads in enumerate(results):
        assert grads["never.weight"] is None and grads["never.bias"] is None, f"rank {rank}: {grads['never.weight']}"
        for name in ("net1.weight", "net1.bias", "net2.weight", "net2.bias"):
            want = dict(model.named_parameters())[name].grad / 2
            torch.testing.assert_close(grads[name], want, **TOL)


def _accumulated(rank, world_size, case):
    """net2 gets gradient only in a no_sync micro-step ("no_sync", on rank 0 only for
    "no_sync_rank0"), or only on rank 0 with rank 1's gradient left from an earlier
    step ("stale"); the synced step does not use it on any rank."""
    torch.manual_seed(0)
    ddp = DDP(TwoBranch(), find_unused_parameters=True)
    x = torch.full((2, 4), float(rank + 1))
    if case == "stale":
        ddp(x).sum().backward()  # both use net2: .grad = mean of the two
        ddp(x, use_net2=(rank == 0)).sum().backward()  # no zero_grad: rank 1's net2.grad is stale
    else:
        with ddp.no_sync():
            ddp(x, use_net2=(case == "no_sync" or rank == 0)).sum().backward()
        ddp(x, use_net2=False).sum().backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in ddp.module.named_parameters()}


@pytest.mark.parametrize("case", ["no_sync", "no_sync_rank0", "stale"])
def test_find_unused_parameters_reduces_gradients_accumulated_before_the_synced_step(case: str):
    """As PyTorch's reducer: a parameter that holds a gradient contributes it even when
    the synced step did not use it, and one that received gradient in a no_sync step
    counts as used, so every rank ends with the same average (not a local gradient)."""
    results = run_ranks(_accumulated, 2, args=(case,), backend="gloo")
    torch.manual_seed(0)
    model = TwoBranch()
    params = dict(model.named_parameters())
    inputs = [torch.full((2, 4), float(r + 1)) for r in range(2)]
    local = []  # each rank's net2 gradient before the final reduction, computed in one process
    for r in range(2):
        model.zero_grad()
        if case == "stale":
            first = [torch.autograd.grad(model(i).sum(), params["net2.weight"])[0] for i in inputs]
            grad = sum(first) / 2 + (torch.autograd.grad(model(inputs[0]).sum(), params["net2.weight"])[0]
                                     if r == 0 else 0)
        elif case == "no_sync" or r == 0:
            grad = torch.autograd.grad(model(inputs[r]).sum(), params["net2.weight"])[0]
        else:
            grad = torch.zeros_like(params["net2.weight"])
        local.append(grad)
    want = (local[0] + local[1]) / 2
    for rank, grads in enumerate(results):
        torch.testing.assert_close(grads["net2.weight"], want, **TOL)
        assert grads["never.weight"] is None, f"rank {rank}"
    assert torch.equal(results[0]["net2.weight"], results[1]["net2.weight"])


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return {"a": self.a(x), "b": self.b(x)}


def _output_unused_in_loss(rank, world_size):
    torch.manual_seed(0)
    ddp = DDP(TwoHeads(), find_unused_parameters=True)
    ddp(torch.ones(2, 3))["a"].sum().backward()  # head b is in the output, not in the loss
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in ddp.module.named_parameters()}


def test_an_output_left_out_of_the_loss_leaves_its_gradients_none():
    """Its parameters' hooks fire without a gradient: not used, so .grad stays None
    (a zero gradient would move them under weight decay or momentum)."""
    for grads in run_ranks(_output_unused_in_loss, 2, backend="gloo"):
        assert grads["b.weight"] is None and grads["b.bias"] is None, grads["b.weight"]
        assert grads["a.weight"] is not None


class _Node:
    """An autograd node whose Python wrapper lives only while referenced, as torch's do
    (torch 2.13's allocation pattern happened to hide the reused ids; 2.11's did not)."""

    def __init__(self, *children: "_Node", variable: torch.Tensor | None = None) -> None:
        self.children, self.variable = children, variable
        self._wrapper = lambda: None

    def wrapper(self) -> "_Wrapper":
        wrapper = self._wrapper()
        if wrapper is None:
            wrapper = _Wrapper(self)
            self._wrapper = weakref.ref(wrapper)
        return wrapper


class _Wrapper:
    def __init__(self, node: _Node) -> None:
        self.variable = node.variable
        self._node = node

    @property
    def next_functions(self):
        return tuple((child.wrapper(), 0) for child in self._node.children)


def test_the_unused_search_reaches_every_leaf_when_torch_frees_node_wrappers():
    """With torch 2.11 the search by wrapper ids took freed wrappers' reused ids for nodes
    already seen, called a head's parameters unused, and DDP then raised "marked as ready
    twice" when their hooks fired."""
    params = [nn.Parameter(torch.zeros(1)) for _ in range(4)]
    a, b = (_Node(*(_Node(variable=p) for p in pair)) for pair in (params[:2], params[2:]))
    root = _Node(a, b)
    output = types.SimpleNamespace(grad_fn=root.wrapper())
    assert reached_leaves([output]) == {id(p) for p in params}


def _unused_error(rank, world_size):
    torch.manual_seed(0)
    ddp = DDP(TwoBranch())
    ddp(torch.randn(2, 4)).sum().backward()  # "never" gets no gradient
    try:
        ddp(torch.randn(2, 4))
    except RuntimeError as exc:
        return str(exc)
    return None


def test_unused_parameter_without_find_unused_raises_next_iteration_naming_it():
    for msg in run_ranks(_unused_error, 2, backend="gloo"):
        assert msg is not None, "the second forward should have raised"
        assert "Expected to have finished reduction in the prior iteration" in msg
        assert "find_unused_parameters=True" in msg
        assert "never.weight" in msg and "never.bias" in msg


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        x = checkpoint(self.layer, x, use_reentrant=True)
        x = checkpoint(self.layer, torch.relu(x), use_reentrant=True)  # the same layer twice
        return self.head(x)


def _train_checkpointed(rank, world_size, model_class, steps, ddp_options):
    torch.manual_seed(0)
    ddp = DDP(model_class(), **ddp_options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(world_size * 2, 6, generator=g, requires_grad=True)
        opt.zero_grad()
        ddp(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
        opt.step()
    return {k: v.detach() for k, v in ddp.module.state_dict().items()}, ddp._get_ddp_logging_data()


def _assert_matches_single_process(results, model_class, steps):
    """Every rank's parameters equal one process's trained on both ranks' batches."""
    torch.manual_seed(0)
    model = model_class()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g, requires_grad=True)
        opt.zero_grad()
        out = model(x)
        (0.5 * out[:2].pow(2).mean() + 0.5 * out[2:].pow(2).mean()).backward()
        opt.step()
    for got, _ in results:
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL)


def test_static_graph_with_reentrant_checkpointing_twice_matches_single_process():
    results = run_ranks(_train_checkpointed, 2, args=(Checkpointed, 3, {"static_graph": True}), backend="gloo")
    _assert_matches_single_process(results, Checkpointed, 3)
    assert all(log["has_rebuilt_buckets"] for _, log in results)


class CheckpointedHead(nn.Module):
    """The last layers under a reentrant checkpoint: the first gradient hooks fire in its
    inner backward, the last ones (``body``'s) in the outer one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return checkpoint(lambda t: self.head(torch.tanh(t)), self.body(x), use_reentrant=True)


def test_reentrant_checkpoint_around_the_last_layers_matches_single_process():
    """The end of backward used to run when the checkpoint's inner backward ended: gradients
    stayed local (ranks drifted apart) and the next forward raised."""
    results = run_ranks(_train_checkpointed, 2, args=(CheckpointedHead, 3, {}), backend="gloo")
    _assert_matches_single_process(results, CheckpointedHead, 3)


class BodyTwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.h1, self.h2 = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        h = self.body(x)
        return self.h1(h), self.h2(h)


def _static_output_not_in_loss(rank, world_size):
    """The loss uses one head: the other's hooks fire without a gradient, which is no use."""
    torch.manual_seed(0)
    model = BodyTwoHeads()
    ddp = DDP(model, static_graph=True)
    a, _ = ddp(torch.full((3, 4), float(rank + 1)))
    a.sum().backward()
    return model.h2.weight.grad, model.h1.weight.grad


def test_static_graph_leaves_grad_none_for_an_output_the_loss_did_not_use():
    """PyTorch leaves ``.grad`` None there (zeros would let weight decay move the head)."""
    (h2_0, h1_0), (h2_1, h1_1) = run_ranks(_static_output_not_in_loss, 2, backend="gloo")
    assert h2_0 is None and h2_1 is None
    torch.testing.assert_close(h1_0, h1_1, rtol=0, atol=0)


class LateLayer(nn.Module):
    """``b`` is used from the second iteration on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.a(x) if self.calls == 1 else self.b(self.a(x))


def _static_late_use(rank, world_size):
    ddp = DDP(LateLayer(), static_graph=True)
    ddp(torch.randn(3, 4)).sum().backward()
    try:
        ddp(torch.randn(3, 4)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_static_graph_parameter_unused_first_then_used_raises_pytorchs_error():
    for msg in run_ranks(_static_late_use, 2, backend="gloo"):
        assert msg is not None and msg.startswith(
            "Your training graph has changed in this iteration, e.g., one parameter is unused in first "
            "iteration, but then got used in the second iteration."), msg
        assert "b." in msg, msg


def _static_changes(rank, world_size):
    torch.manual_seed(0)
    ddp = DDP(TwoBranch(), static_graph=True)
    ddp(torch.randn(2, 4)).sum().backward()
    ddp(torch.randn(2, 4), use_net2=False).sum().backward()  # the change: PyTorch raises at the next forward
    try:
        ddp(torch.randn(2, 4))
    except RuntimeError as exc:
        return str(exc)
    return None


def test_static_graph_that_changes_raises_at_the_next_forward():
    for msg in run_ranks(_static_changes, 2, backend="gloo"):
        assert msg is not None and msg.startswith(
            "Expected to have finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your training graph has changed in this iteration"), msg
        assert "net2.weight" in msg, msg


class CheckpointedTwiceAfterPre(Checkpointed):
    """``Checkpointed`` after a layer whose gradient comes last: the bucket is still open
    when the reused layer's hook fires the second time. (Without ``pre`` the bucket is
    complete after the first inner backward, whose end then finishes the reduction, and
    the second firing only accumulates locally, in PyTorch as here.)"""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(6, 6)

    def forward(self, x):
        return super().forward(self.pre(x))


def _twice(rank, world_size):
    torch.manual_seed(0)
    ddp = DDP(CheckpointedTwiceAfterPre())  # one layer checkpointed twice: two reentrant backwards, two hook firings
    try:
        ddp(torch.randn(2, 6, requires_grad=True)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("world_size", [2])
def test_parameter_marked_ready_twice_raises(world_size):
    for msg in run_ranks(_twice, world_size, backend="gloo"):
        assert msg is not None and "Expected to mark a variable ready only once" in msg, msg


def _static_graph_with_find_unused_warnings(rank, world_size):
    import warnings
    messages = {}
    for how in ("constructor", "_set_static_graph"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = DDP(nn.Linear(2, 2), find_unused_parameters=True, static_graph=how == "constructor")
            if how == "_set_static_graph":
                ddp._set_static_graph()
        messages[how] = [str(w.message) for w in caught if "will detect unused parameters" in str(w.message)]
    return messages


def test_static_graph_with_find_unused_parameters_warns_as_pytorch():
    [messages] = run_ranks(_static_graph_with_find_unused_warnings, 1, backend="gloo", timeout=60)
    assert all(len(found) == 1 for found in messages.values()), messages
