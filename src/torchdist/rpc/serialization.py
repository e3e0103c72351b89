"""Pickling for RPC: protocol 5 with tensors out of band, RRef forks, remote errors.

Sending (:func:`dumps`): a :class:`pickle.Pickler` whose ``dispatch_table`` turns
every dense CPU tensor into ``_rebuild_tensor(PickleBuffer(bytes of the tensor's
own memory), dtype, shape, ...)``. ``buffer_callback`` collects those buffers, so
they leave the pickle stream and travel as separate frame parts (see
:mod:`~torchdist.rpc.wire`), sent by ``sendmsg`` from the tensor memory itself.
Only a tensor's own elements are sent (a view of a large storage sends the view).
Other types register reducers with :func:`register_reducer`; the RRef module uses
that to create a fork for the destination (the reducer sees :class:`SendState`).

Receiving (:func:`loads`): ``pickle.loads(payload, buffers=...)`` hands each
out-of-band buffer (a numpy view of the received uint8 tensor) to ``_rebuild_tensor``, which views it with the right
dtype and shape (no copy). Rebuild functions that need to know about the message
(who sent it, its autograd context) read the :class:`RecvState` that ``loads``
publishes in a thread-local while it runs.

Remote errors travel as ``(type, message)`` and are rebuilt on the caller as
PyTorch does: the same type, with a message that starts ``On WorkerInfo(...)``
and contains the remote traceback.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["SendState", "RecvState", "dumps", "loads", "register_reducer", "current_recv_state",
           "pack_exception", "unpack_exception"]

_local = threading.local()
INBAND_BYTES = 4096  # tensors up to this size travel inside the pickle (see _reduce_tensor)
_REDUCERS: dict[type, Callable[["SendState", Any], tuple]] = {}


@dataclass
class SendState:
    """What the pickling of one message collects and knows."""

    dst: int                                    # destination worker id
    buffers: list[memoryview] = field(default_factory=list)
    grad_tensors: list[torch.Tensor] = field(default_factory=list)  # requires_grad, in pickle order
    keep_alive: list[Any] = field(default_factory=list)             # tensors backing the buffers


@dataclass
class RecvState:
    """What rebuild functions may consult while one message is unpickled."""

    src: int                                    # sender's worker id
    on_grad_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None
    after_load: list[Callable[[], None]] = field(default_factory=list)


def register_reducer(cls: type, reducer: Callable[[SendState, Any], tuple]) -> None:
    """Pickle instances of exactly ``cls`` with ``reducer(state, obj)`` inside RPC messages."""
    _REDUCERS[cls] = reducer
    _Pickler.dispatch_table = _build_dispatch_table()


def current_recv_state() -> RecvState | None:
    """The state of the message being unpickled on this thread, if any."""
    return getattr(_local, "recv", None)


# -- tensors -----------------------------------------------------------------------------
def _rebuild_tensor(raw: Any, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool,
                    is_param: bool) -> torch.Tensor:
    if isinstance(raw, np.ndarray):  # an out-of-band buffer (``loads`` hands them over as arrays)
        raw = torch.from_numpy(raw)
    elif not isinstance(raw, torch.Tensor):
        # In-band bytes: a small tensor's (a bytearray we own), or a message loaded without
        # our buffer list (copied once).
        if not isinstance(raw, bytearray):
            raw = bytearray(memoryview(raw))
        raw = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    # A base tensor over the buffer's storage, not a view of ``raw``: no copy, and autograd
    # (the recv hook marks it dirty) treats it as a tensor of its own.
    tensor = torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), raw.storage_offset(), shape)
    state = current_recv_state()
    if requires_grad and state is not None and state.on_grad_tensor is not None:
        tensor = state.on_grad_tensor(tensor)  # distributed autograd: record a recv point
    elif requires_grad:
        tensor.requires_grad_(True)
    if is_param:
        tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    state: SendState = _local.send
    if tensor.layout is not torch.strided or not tensor.is_cpu or tensor.is_quantized:
        return tensor.__reduce_ex__(5)  # rare kinds: torch's own (in-band) pickling
    data = tensor.detach()
    if not data.is_contiguous() or data.is_conj() or data.is_neg():
        data = data.resolve_conj().resolve_neg().contiguous()
    if tensor.requires_grad:
        state.grad_tensors.append(tensor)
    flat = data.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:  # "contiguous" whatever its stride (e.g. expand(1))
        flat = flat.clone(memory_format=torch.contiguous_format)
    raw: Any = flat.view(torch.uint8).numpy()
    if raw.nbytes <= INBAND_BYTES:
        # Small: the bytes go inside the pickle. An out-of-band buffer costs more (a frame
        # part, an allocation and a tensor on the receiver) than copying a few KiB.
        raw = bytearray(raw)
    else:
        state.keep_alive.append(flat)
        raw = pickle.PickleBuffer(raw)
    return (_rebuild_tensor, (raw, data.dtype, tuple(data.shape), tensor.requires_grad,
                              isinstance(tensor, torch.nn.Parameter)))


def _reducer_of(reducer: Callable[[SendState, Any], tuple]) -> Callable[[Any], tuple]:
    return lambda obj: reducer(_local.send, obj)


def _build_dispatch_table() -> dict:
    table = dict(copyreg.dispatch_table)
    table[torch.Tensor] = _reduce_tensor
    table[torch.nn.Parameter] = _reduce_tensor
    for cls, reducer in _REDUCERS.items():
        table[cls] = _reducer_of(reducer)
    return table


class _Pickler(pickle.Pickler):
    """Protocol 5 with our reducers. The dispatch table is built once (copying it per
    message cost ~20 us of a ~60 us encode); reducers find the message's SendState in
    a thread-local."""

    dispatch_table: dict = {}

    def __init__(self, file: io.BytesIO, state: SendState) -> None:
        super().__init__(file, protocol=5, buffer_callback=state.buffers.append)


_Pickler.dispatch_table = _build_dispatch_table()


def dumps(obj: Any, dst: int) -> tuple[bytes, SendState]:
    """Pickle ``obj`` for worker ``dst``; the state holds the out-of-band buffers (PickleBuffers)."""
    state = SendState(dst)
    out = io.BytesIO()
    previous = getattr(_local, "send", None)
    _local.send = state
    try:
        _Pickler(out, state).dump(obj)
    finally:
        _local.send = previous
    state.buffers = [buf.raw() for buf in state.buffers]
    return out.getvalue(), state


def loads(payload: bytes | bytearray, buffers: list[torch.Tensor], state: RecvState) -> Any:
    """Unpickle a message, with ``state`` visible to rebuild functions on this thread.

    The out-of-band buffers go to ``pickle`` as numpy views of the received tensors (no
    copy): not only our tensors' rebuild reads them, but also any type that pickles its
    own buffers out of band (numpy arrays), which wants an object with the buffer protocol."""
    previous = getattr(_local, "recv", None)
    _local.recv = state
    try:
        obj = pickle.loads(payload, buffers=[buffer.numpy() for buffer in buffers])
    finally:
        _local.recv = previous
    for callback in state.after_load:
        callback()
    return obj


# -- remote exceptions -------------------------------------------------------------------
def pack_exception(exc: BaseException, where: str) -> bytes:
    """Pickle an exception raised on this worker: its type (if importable) and a full message."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = f"On {where}:\n{exc!r}\n{text}"
    try:
        return pickle.dumps((type(exc), message, type(exc).__qualname__))
    except Exception:  # a type defined where the caller cannot import it
        return pickle.dumps((None, message, type(exc).__qualname__))


def unpack_exception(payload: bytes) -> BaseException:
    """Rebuild a remote exception as PyTorch does: same type when it can be made, else RuntimeError."""
    try:
        exc_type, message, type_name = pickle.loads(payload)
    except Exception as exc:  # the caller cannot import the remote exception's type
        return RuntimeError(f"Remote exception that could not be unpickled here ({exc!r})")
    if exc_type is None:
        return RuntimeError(f"Remote exception of type {type_name}: {message}")
    if not issubclass(exc_type, Exception):  # SystemExit, KeyboardInterrupt, ...: a Future holds Exceptions only
        return RuntimeError(f"{type_name}: {message}")
    try:
        return exc_type(message)
    except Exception as exc:
        return RuntimeError(f"Failed to create original exception type. Error msg was {exc} "
                            f"Original exception on remote side was {message}")
