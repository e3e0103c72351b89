"""What RPC messages carry: tensors of every stride, numpy arrays; in one process and between workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchdist.autograd as dist_autograd
import torchdist.rpc as rpc
from torchdist.rpc.serialization import RecvState, dumps, loads, INBAND_BYTES
from torchdist.testing import run_ranks

from ._common import name, start


def _round_trip(obj):
    """What a receiver rebuilds from ``obj``'s message (buffers as the wire delivers them)."""
    payload, state = dumps(obj, 1)
    buffers = [torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf.nbytes else
               torch.empty(0, dtype=torch.uint8) for buf in state.buffers]
    return loads(payload, buffers, RecvState(0))


_big = INBAND_BYTES  # elements: a float tensor this long goes out of band
_STRIDED = {
    # one element (or none) with a stride other than 1: torch calls these contiguous
    "expand(1)": torch.tensor(1.0).expand(1),
    "expand(1, 1)": torch.tensor(1.0).expand(1, 1),
    "column of a row": torch.arange(4.0).reshape(1, 4)[:, 1],
    "imag of conj": torch.tensor([1 + 2j]).conj().imag,
    "empty expand": torch.tensor(5.0).expand(0),
    "empty transposed": torch.empty(0, 3).t(),
    # out of band
    "large expand": torch.tensor(3.0).expand(_big),
    "large column": torch.arange(2.0 * _big).reshape(_big, 2)[:, 1],
    "one of a large tensor": torch.arange(2.0 * _big)[_big:_big + 1],
}


@pytest.mark.parametrize("tensor", _STRIDED.values(), ids=_STRIDED.keys())
def test_tensors_of_any_stride_round_trip(tensor):
    back = _round_trip(tensor)
    assert torch.equal(back, tensor) and back.dtype == tensor.dtype


@pytest.mark.parametrize("array", [np.arange(3), np.zeros(0), np.arange(4 * _big, dtype=np.float32).reshape(4, _big),
                                   np.arange(12.0).reshape(3, 4)[:, ::2]], ids=["small", "empty", "large", "strided"])
def test_numpy_arrays_round_trip(array):
    back = _round_trip({"obs": array, "t": torch.ones(_big)})
    assert isinstance(back["obs"], np.ndarray) and back["obs"].dtype == array.dtype
    assert np.array_equal(back["obs"], array) and torch.equal(back["t"], torch.ones(_big))


def _identity(x):
    return x


def _numpy_and_single_element_gradients(rank, world_size):
    start(rank, world_size)
    result = None
    if rank == 0:
        observation = np.arange(3 * _big, dtype=np.float64)
        echoed = rpc.rpc_sync(name(1), _identity, args=(observation,))
        x = torch.ones(1, requires_grad=True)
        with dist_autograd.context() as context_id:
            # the gradient of sum() that flows back to worker 1 is a stride-0 expand of shape (1,)
            y = rpc.rpc_sync(name(1), torch.mul, args=(x, 2.0)).sum()
            dist_autograd.backward(context_id, [y])
            grad = dist_autograd.get_gradients(context_id)[x]
        result = (np.array_equal(echoed, observation), grad)
    rpc.shutdown()
    return result


def test_numpy_arrays_and_single_element_gradients_cross_workers():
    same, grad = run_ranks(_numpy_and_single_element_gradients, 2, timeout=30)[0]
    assert same and torch.equal(grad, torch.tensor([2.0]))
