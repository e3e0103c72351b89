"""Staging for ``async_save``: a copy of the state_dict that training may not change while it is written.

``async_save`` calls ``stager.stage(state_dict)`` before it returns and saves
what that gives (a state_dict, or a Future of one) in a background thread, so
the caller may update its tensors as soon as staging is done.

    AsyncStager          the protocol: stage / synchronize_staging / close, and should_synchronize_after_execute
    BlockingAsyncStager  fresh CPU tensors, copied before ``stage`` returns (optionally into a cache reused
                         by later saves); what PyTorch's FileSystemWriter stages with
    DefaultStager        a deep copy with tensors moved to CPU (views of one storage stay views of one copy),
                         in the caller's thread or, with ``use_async_staging``, in a thread of its own
                         (``stage`` then returns a Future and ``async_save`` an ``AsyncSaveResponse``)
"""

from __future__ import annotations

import copy
import io
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from typing_extensions import deprecated

from ..tensor import DTensor
from ._chunks import LocalShards

__all__ = ["AsyncStager", "BlockingAsyncStager", "DefaultStager", "StagingOptions"]

_ATOMIC = (int, float, str, bytes, io.BytesIO)  # kept as they are by the blocking stager, as in PyTorch


@runtime_checkable
class AsyncStager(Protocol):
    """What ``async_save`` asks of a stager (PyTorch's protocol, member for member).

    1. ``stage(state_dict)``: a "training-safe" copy, or a Future of one;
    2. the copy is saved in the background;
    3. if ``should_synchronize_after_execute``, ``async_save`` calls ``synchronize_staging()`` before it returns.
    """

    _synchronize_after_execute: bool = True

    @property
    def should_synchronize_after_execute(self) -> bool:
        """Whether ``async_save`` waits for staging (``synchronize_staging``) before returning."""
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]] | dict[str, Any]:
        """A copy of ``state_dict`` that later updates of its tensors do not reach."""
        raise NotImplementedError(f"{self.__class__.__name__} must implement stage method")

    @deprecated("`synchronize_staging` is deprecated and will be removed in future versions."
                "Please use staging_future from AsyncSaveResponse instead.", category=FutureWarning)
    def synchronize_staging(self) -> None:
        """Wait until staging is done, when ``stage`` works in the background."""

    def close(self) -> None:
        """Release what the stager holds (threads, cached copies)."""


@dataclass
class StagingOptions:
    """How ``DefaultStager`` stages; the accelerator-only options need one (see ``DefaultStager``)."""

    use_pinned_memory: bool = True  # page-locked copies (CUDA only; ignored with a warning without it)
    use_shared_memory: bool = True  # copies in shared memory, for a writer in another process
    use_async_staging: bool = True  # stage in a thread of the stager's own; ``stage`` returns a Future
    use_non_blocking_copy: bool = True  # device-to-host copies without waiting for each (needs an accelerator)


def _walk(value: Any, tensor_fn: Callable[[torch.Tensor], torch.Tensor], other_fn: Callable[[Any], Any]) -> Any:
    """``value`` rebuilt: containers entered, tensors (DTensor local parts, shards) through ``tensor_fn``."""
    if isinstance(value, DTensor):
        # the same mesh and placements; only the local part is copied
        return DTensor(tensor_fn(value._local_tensor.detach()), value._spec, requires_grad=value.requires_grad)
    if isinstance(value, LocalShards):
        return LocalShards(value.size, [(c.offsets, tensor_fn(c.tensor.detach())) for c in value.chunks])
    if isinstance(value, torch.Tensor):
        return tensor_fn(value.detach())
    if isinstance(value, dict):
        return {key: _walk(item, tensor_fn, other_fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_walk(item, tensor_fn, other_fn) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    return other_fn(value)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors ``_walk`` passes to ``tensor_fn``, in its order."""
    found: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    _walk(value, keep, lambda other: other)
    return found


class BlockingAsyncStager(AsyncStager):
    """Stages to fresh CPU tensors before ``stage`` returns; ``synchronize_staging`` has nothing to wait for.

    With ``cache_staged_state_dict`` the first stage's tensors are kept and later stages copy into them (less
    allocation, the memory stays held): keep one stager for the saves of one state_dict layout.
    ``type_check`` refuses values DCP does not know (tensors, DTensor, int, float, str, bytes, None, and
    dicts/lists/tuples of them) instead of deep-copying them.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, cache_staged_state_dict: bool = False, type_check: bool = False) -> None:
        self.cache_staged_state_dict = cache_staged_state_dict
        self.type_check = type_check
        self.state_dict_cache: dict[str, Any] | None = None

    def _other(self, value: Any, type_check: bool) -> Any:
        if value is None or isinstance(value, _ATOMIC):
            return value
        if type_check:
            raise ValueError(f"Unexpected value type {type(value)}")
        return copy.deepcopy(value)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` on the CPU (into the cached tensors when caching)."""
        if not self.cache_staged_state_dict:
            return _walk(state_dict, _fresh_copy, lambda v: self._other(v, self.type_check))
        if self.state_dict_cache is None:
            # PyTorch pins the cache; page-locking needs CUDA, so without it the cache is ordinary memory
            self.state_dict_cache = _walk(state_dict, lambda t: _fresh_copy(t, pin=torch.cuda.is_available()),
                                          lambda v: self._other(v, True))
            return self.state_dict_cache
        return self._copy_into_cache(state_dict)

    def _copy_into_cache(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        cached = _tensors(self.state_dict_cache)
        sources = _tensors(state_dict)
        if len(cached) != len(sources) or any(c.shape != s.shape for c, s in zip(cached, sources)):
            raise ValueError(f"BlockingAsyncStager: the state_dict holds {len(sources)} tensors of other shapes than "
                             f"the {len(cached)} cached by the first stage; use cache_staged_state_dict=True only "
                             "for saves of one state_dict layout")
        pending = iter(cached)

        def copy_into(tensor: torch.Tensor) -> torch.Tensor:
            return next(pending).copy_(tensor)

        return _walk(state_dict, copy_into, lambda v: self._other(v, True))

    def synchronize_staging(self) -> None:
        """Nothing to wait for: staging is done when ``stage`` returns."""

    def close(self) -> None:
        """Nothing to release."""


def _fresh_copy(tensor: torch.Tensor, pin: bool = False) -> torch.Tensor:
    """A new CPU tensor (contiguous, not requiring grad) with ``tensor``'s values."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    return out.copy_(tensor)


class _StorageCopier:
    """Copies tensors to CPU one storage at a time, so that views of one storage stay views of one copy."""

    def __init__(self, pin_memory: bool, share_memory: bool, non_blocking: bool) -> None:
        self.pin_memory, self.share_memory, self.non_blocking = pin_memory, share_memory, non_blocking
        self.copies: dict[tuple[str, int], torch.UntypedStorage] = {}

    def _storage(self, tensor: torch.Tensor) -> torch.UntypedStorage:
        storage = tensor.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if storage.data_ptr() == 0 or key not in self.copies:
            staged = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.pin_memory).untyped_storage()
            staged.copy_(storage, non_blocking=self.non_blocking)
            if self.share_memory:
                staged.share_memory_()
            self.copies[key] = staged
        return self.copies[key]

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout != torch.strided or tensor.is_quantized:
            return tensor.detach().to("cpu", copy=True)  # no storage to share: a plain copy
        out = torch.empty(0, dtype=tensor.dtype)
        return out.set_(self._storage(tensor), tensor.storage_offset(), tensor.shape, tensor.stride())


class DefaultStager(AsyncStager):
    """Stages a deep copy of the state_dict with its tensors on the CPU (PyTorch's default stager).

    ``StagingOptions(False, False, False, False)`` is what ``async_save`` uses when given no stager.
    With ``use_async_staging`` the copy is made in a thread of the stager's own and ``stage`` returns a
    Future; ``use_non_blocking_copy`` needs an accelerator (AssertionError otherwise, as in PyTorch), and
    so does the PyTorch default ``StagingOptions()``. Not thread-safe; ``close()`` when done.
    """

    def __init__(self, config: StagingOptions = StagingOptions()) -> None:
        self._config = config
        pin = config.use_pinned_memory
        if pin and not torch.cuda.is_available():
            warnings.warn("Ignoring pin_memory flag for checkpoint staging as pinning memory requires CUDA, but "
                          "CUDA is not available. ", stacklevel=2)
            pin = False
        self._pin_memory = pin
        if config.use_non_blocking_copy and not torch.accelerator.is_available():
            raise AssertionError("Non-blocking copy requires that the current accelerator is available.")
        self._staging_executor = ThreadPoolExecutor(max_workers=1) if config.use_async_staging else None
        self._staging_future: Future[dict[str, Any]] | None = None

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any] | Future[dict[str, Any]]:
        """The staged copy, or (with ``use_async_staging``) a Future of it."""
        if self._staging_executor is None:
            return self._stage(state_dict)
        self._staging_future = self._staging_executor.submit(self._stage, state_dict)
        return self._staging_future

    def _stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        non_blocking = self._config.use_non_blocking_copy
        copier = _StorageCopier(self._pin_memory, self._config.use_shared_memory, non_blocking)
        memo: dict[int, Any] = {}  # one deep-copy memo: an object met twice is copied once
        staged = _walk(state_dict, copier, lambda value: copy.deepcopy(value, memo))
        if non_blocking:
            torch.accelerator.synchronize()  # the copies were only queued
        return staged

    def synchronize_staging(self) -> None:
        """Wait for the last ``stage`` (a no-op without ``use_async_staging``)."""
        if self._staging_future is not None:
            self._staging_future.result()

    def close(self) -> None:
        """Stop the staging thread (after the staging in progress); the stager is not used after this."""
        if self._staging_executor is not None:
            self._staging_executor.shutdown(wait=True)
