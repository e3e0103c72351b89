"""Distributed autograd and DistributedOptimizer against local autograd and local optimizers."""

from __future__ import annotations

import torch

import torchdist.autograd as dist_autograd
import torchdist.rpc as rpc
from torchdist.autograd.engine import FREED_GRAPH_MESSAGE
from torchdist.optim import DistributedOptimizer
from torchdist.testing import run_ranks

from ._common import start

_MODULES: dict[str, torch.nn.Module] = {}


def _make_layer(key, seed, n_in, n_out):
    torch.manual_seed(seed)
    _MODULES[key] = torch.nn.Linear(n_in, n_out)
    return [p.detach().clone() for p in _MODULES[key].parameters()]


def _forward(key, x, next_hop=None):
    h = torch.tanh(_MODULES[key](x))
    if next_hop is not None:  # nested RPC inside the context: worker1 -> worker2
        h = rpc.rpc_sync(next_hop[0], _forward, args=(next_hop[1], h)) + h.sum()
    return h


def _grads(key, context_id):
    grads = dist_autograd.get_gradients(context_id)
    params = list(_MODULES[key].parameters())
    return [grads.get(p) for p in params], [p.grad for p in params]


def _param_rrefs(key):
    return [rpc.RRef(p) for p in _MODULES[key].parameters()]


def _reference(x, w0, layers):
    """The same computation in one process, with local autograd."""
    w0 = w0.clone().requires_grad_()
    modules = []
    for params in layers:
        lin = torch.nn.Linear(params[0].shape[1], params[0].shape[0])
        with torch.no_grad():
            lin.weight.copy_(params[0])
            lin.bias.copy_(params[1])
        modules.append(lin)
    h0 = x @ w0
    h1 = torch.tanh(modules[0](h0))
    if len(modules) > 1:
        h1 = torch.tanh(modules[1](h1)) + h1.sum()
    loss = (h1 * h0[:, : h1.shape[1]]).sum()  # h0 used twice: two paths into worker0's parameter
    loss.backward()
    return w0.grad, [[p.grad for p in m.parameters()] for m in modules]


def _split_model(rank, world_size):
    start(rank, world_size)
    out = None
    if rank == 0:
        layers = [rpc.rpc_sync(f"worker{r}", _make_layer, args=(f"l{r}", r, 4 if r == 1 else 3, 3))
                  for r in range(1, world_size)]
        torch.manual_seed(0)
        x, w0 = torch.randn(5, 4), torch.randn(4, 4, requires_grad=True)
        next_hop = ("worker2", "l2") if world_size == 3 else None
        with dist_autograd.context() as context_id:
            h0 = x @ w0
            h1 = rpc.rpc_sync("worker1", _forward, args=("l1", h0, next_hop))
            loss = (h1 * h0[:, : h1.shape[1]]).sum()
            dist_autograd.backward(context_id, [loss])
            mine = dist_autograd.get_gradients(context_id)[w0]
            remote = [rpc.rpc_sync(f"worker{r}", _grads, args=(f"l{r}", context_id)) for r in range(1, world_size)]
        ref_w0, ref_layers = _reference(x, w0.detach(), layers)
        out = (torch.allclose(mine, ref_w0, atol=1e-6), w0.grad is None,
               [all(torch.allclose(g, r, atol=1e-6) for g, r in zip(grads, ref)) for (grads, _), ref in
                zip(remote, ref_layers)],
               [all(g is None for g in dot_grads) for _, dot_grads in remote])
    rpc.shutdown()
    return out


def test_gradients_equal_local_autograd_on_two_workers():
    mine_ok, untouched, remote_ok, remote_untouched = run_ranks(_split_model, 2, timeout=30)[0]
    assert mine_ok and untouched and remote_ok == [True] and remote_untouched == [True]


def test_gradients_equal_local_autograd_on_three_workers_with_nested_rpc():
    mine_ok, untouched, remote_ok, remote_untouched = run_ranks(_split_model, 3, timeout=30)[0]
    assert mine_ok and untouched and remote_ok == [True, True] and remote_untouched == [True, True]


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("backward exploded")


def _fails_in_backward(x):
    return _FailingBackward.apply(x)


def _autograd_errors(rank, world_size):
    start(rank, world_size)
    errors = {}
    if rank == 0:
        def catch(key, fn):
            try:
                fn()
            except RuntimeError as exc:
                errors[key] = str(exc)

        catch("unknown", lambda: dist_autograd.get_gradients(12345))
        catch("unknown_backward", lambda: dist_autograd.backward(99, [torch.ones((), requires_grad=True)]))
        with dist_autograd.context() as context_id:
            catch("nested", lambda: dist_autograd.context().__enter__())
            catch("not_scalar", lambda: dist_autograd.backward(context_id, [torch.ones(2, requires_grad=True)]))
            catch("no_grad", lambda: dist_autograd.backward(context_id, [torch.ones(())]))
            catch("no_roots", lambda: dist_autograd.backward(context_id, []))
            received = rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(2, requires_grad=True), 3))
            catch("local_backward", lambda: received.sum().backward())
            x = torch.ones(3, requires_grad=True)
            y = rpc.rpc_sync("worker1", _fails_in_backward, args=(x,))
            catch("remote", lambda: dist_autograd.backward(context_id, [y.sum()]))
        errors["context_ids_differ"] = context_id != (1 << 48)
    rpc.shutdown()
    return errors


def test_autograd_errors_match_pytorch():
    errors = run_ranks(_autograd_errors, 2, timeout=30)[0]
    assert errors["unknown"] == "Could not find autograd context with id: 12345"
    assert errors["unknown_backward"] == "Could not find autograd context with id: 99"
    assert errors["nested"] == "Already have an autograd context id for this thread."
    assert "is not a scalar, all roots need to be scalar" in errors["not_scalar"]
    assert "requires_grad not set on root" in errors["no_grad"]
    assert errors["no_roots"] == "No tensors provided for gradient computation."
    assert "use torchdist.autograd.backward(context_id, roots)" in errors["local_backward"]
    assert "Error on Node 1" in errors["remote"] and "backward exploded" in errors["remote"]


def _optimizer(rank, world_size):
    start(rank, world_size)
    out = None
    if rank == 0:
        initial = [rpc.rpc_sync(f"worker{r}", _make_layer, args=(f"l{r}", r, 4, 4)) for r in (1, 2)]
        params = [p for r in (1, 2) for p in rpc.rpc_sync(f"worker{r}", _param_rrefs, args=(f"l{r}",))]
        optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.5, momentum=0.9)
        x = torch.randn(3, 4)
        for _ in range(2):
            with dist_autograd.context() as context_id:
                h = rpc.rpc_sync("worker1", _forward, args=("l1", x))
                y = rpc.rpc_sync("worker2", _forward, args=("l2", h))
                dist_autograd.backward(context_id, [y.sum()])
                optimizer.step(context_id)
        after = [[p.to_here() for p in params[:2]], [p.to_here() for p in params[2:]]]
        # the same two steps with local modules and a local SGD
        lins = []
        for weights in initial:
            lin = torch.nn.Linear(4, 4)
            with torch.no_grad():
                lin.weight.copy_(weights[0])
                lin.bias.copy_(weights[1])
            lins.append(lin)
        local = torch.optim.SGD([p for lin in lins for p in lin.parameters()], lr=0.5, momentum=0.9)
        for _ in range(2):
            local.zero_grad()
            torch.tanh(lins[1](torch.tanh(lins[0](x)))).sum().backward()
            local.step()
        expected = [[p.detach() for p in lin.parameters()] for lin in lins]
        out = all(torch.allclose(a, b, atol=1e-6) for la, lb in zip(after, expected) for a, b in zip(la, lb))
        try:
            DistributedOptimizer(torch.optim.SGD, params, lr=-1.0)
        except ValueError as exc:
            out = (out, str(exc))
    rpc.shutdown()
    return out


def test_distributed_optimizer_step_equals_local_optimizer_step():
    same, constructor_error = run_ranks(_optimizer, 3, timeout=30)[0]
    assert same
    assert "Invalid learning rate" in constructor_error and "On WorkerInfo(id=1, name=worker1)" in constructor_error


def _square_sum(x):
    return (x * x).sum() * 2


def _retain_graph(rank, world_size):
    start(rank, world_size)
    out = {}
    if rank == 0:
        w = torch.ones(3, requires_grad=True)

        def attempt(key, fn):
            try:
                fn()
                out[key] = "ok"
            except RuntimeError as exc:
                out[key] = str(exc)

        with dist_autograd.context() as c:  # the graph spans both workers
            loss = rpc.rpc_sync("worker1", _square_sum, args=(w * 3,))
            attempt("dist1", lambda: dist_autograd.backward(c, [loss]))
            attempt("dist2", lambda: dist_autograd.backward(c, [loss]))
            attempt("through_freed", lambda: dist_autograd.backward(c, [loss * 1]))
            out["g_dist"] = dist_autograd.get_gradients(c)[w]
        with dist_autograd.context() as c:
            loss = rpc.rpc_sync("worker1", _square_sum, args=(w * 3,))
            attempt("retain1", lambda: dist_autograd.backward(c, [loss], retain_graph=True))
            attempt("retain2", lambda: dist_autograd.backward(c, [loss]))
            attempt("retain3", lambda: dist_autograd.backward(c, [loss]))
            out["g_retain"] = dist_autograd.get_gradients(c)[w]
        with dist_autograd.context() as c:  # a local graph, then a fresh graph in the same context
            loss = (w * w).sum() * 2
            attempt("local1", lambda: dist_autograd.backward(c, [loss]))
            attempt("local2", lambda: dist_autograd.backward(c, [loss]))
            fresh = rpc.rpc_sync("worker1", _square_sum, args=(w * 3,))
            attempt("fresh", lambda: dist_autograd.backward(c, [fresh]))
            out["g_fresh"] = dist_autograd.get_gradients(c)[w]
        out["w_grad"] = w.grad
    rpc.shutdown()
    return out


def test_retain_graph_false_frees_the_graph_like_pytorch():
    """The outcomes torch.distributed.autograd gives for the same program (measured on torch 2.13)."""
    out = run_ranks(_retain_graph, 2, timeout=30)[0]
    remote_freed = f"Error on Node 0: Error on Node 1: {FREED_GRAPH_MESSAGE}"
    assert out["dist1"] == "ok"
    assert out["dist2"].startswith(remote_freed)
    assert out["through_freed"].startswith(remote_freed)
    assert torch.equal(out["g_dist"], torch.full((3,), 36.0))
    assert (out["retain1"], out["retain2"]) == ("ok", "ok")
    assert out["retain3"].startswith(remote_freed)
    assert torch.equal(out["g_retain"], torch.full((3,), 72.0))
    assert out["local1"] == "ok"
    assert out["local2"].startswith(f"Error on Node 0: {FREED_GRAPH_MESSAGE}")
    assert out["fresh"] == "ok"
    assert torch.equal(out["g_fresh"], torch.full((3,), 40.0))
    assert out["w_grad"] is None


_OWNED = torch.nn.Parameter(torch.ones(2))


def _owned_rref():
    return rpc.RRef(_OWNED)


def _times_owned(x):
    return x * _OWNED


def _owned_state():
    return _OWNED.detach().clone(), _OWNED.grad is None


def _optimizer_over_own_and_remote_parameters(rank, world_size):
    start(rank, world_size)
    out = None
    if rank == 0:
        local = torch.nn.Linear(2, 2)
        before = [p.detach().clone() for p in local.parameters()]
        params = [rpc.RRef(p) for p in local.parameters()] + [rpc.rpc_sync("worker1", _owned_rref)]
        optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=1.0)
        with dist_autograd.context() as context_id:
            loss = local(torch.ones(1, 2)).sum() + rpc.rpc_sync("worker1", _times_owned, args=(torch.ones(2),)).sum()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        after = [p.detach() for p in local.parameters()]
        out = {"local_moved": [torch.equal(a, b - 1) for a, b in zip(after, before)],
               "local_grads_untouched": [p.grad is None for p in local.parameters()],
               "remote": rpc.rpc_sync("worker1", _owned_state)}
    rpc.shutdown()
    return out


def test_distributed_optimizer_steps_the_callers_own_parameters_and_leaves_grad_alone():
    # SGD with lr 1: every weight's gradient here is 1. The caller's parameters are its
    # own RRefs (remote() to itself keeps the optimizer over them, not over copies).
    out = run_ranks(_optimizer_over_own_and_remote_parameters, 2, timeout=30)[0]
    assert out["local_moved"] == [True, True]
    assert out["local_grads_untouched"] == [True, True]
    value, grad_is_none = out["remote"]
    assert torch.equal(value, torch.zeros(2)) and grad_is_none
