"""``functions.async_execution``: functions that reply with a Future instead of a value.

A decorated function returns a ``torch.futures.Future``; the callee's thread goes
back to the pool at once, and the RPC's response is sent when that Future
completes (its value, or its error). This is how a server batches requests or
chains further RPCs without parking a thread per request. Works on plain
functions and, under ``@staticmethod``/``@classmethod``, on methods; decorate
inside those (``@staticmethod`` outermost).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

__all__ = ["async_execution", "check_async_result", "is_async"]


def async_execution(fn: Callable) -> Callable:
    """Mark ``fn`` as returning a ``torch.futures.Future`` whose value is the RPC's reply."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._async_execution = True  # read by the dispatcher on the callee
    return wrapper


def is_async(fn: Any) -> bool:
    return bool(getattr(fn, "_async_execution", False))


def check_async_result(fn: Any, result: Any) -> torch.futures.Future:
    """Raise RuntimeError, as PyTorch does, when an async function did not return a Future."""
    if not isinstance(result, torch._C.Future):
        name = getattr(fn, "__qualname__", repr(fn))
        raise RuntimeError(f"Functions decorated with @rpc.functions.async_execution must return a "
                           f"torch.futures.Future object, but got {type(result).__module__}."
                           f"{type(result).__qualname__} from {name}")
    return result
