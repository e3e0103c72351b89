"""``RemoteModule``: an ``nn.Module`` that lives on another worker (``torch.distributed.nn.RemoteModule``).

``RemoteModule("ps/cpu", nn.EmbeddingBag, args=(100, 16))`` builds the module on
worker ``ps`` with ``rpc.remote`` and keeps the RRef (``module_rref``). Locally it is
an ``nn.Module`` with no state of its own: ``forward`` / ``forward_async`` run the
remote module's ``forward`` through ``rpc_async`` (so inside a distributed autograd
context the call is recorded and ``torchdist.autograd.backward`` reaches the remote
parameters), and ``remote_parameters()`` hands out RRefs to those parameters for
``torchdist.optim.DistributedOptimizer``. ``nn.Module`` methods that would need the
parameters here (``parameters``, ``state_dict``, ``to``, hooks, ...) raise PyTorch's
``ValueError``; ``train()``/``eval()`` run on the remote module and return a copy of it.

A RemoteModule travels inside RPCs as its few attributes (the RRef forked for the
receiver, see :mod:`torchdist.rpc.rref`); the plain pickler refuses it, as PyTorch's
does. PyTorch generates ``forward``/``forward_async`` from a template; the
non-TorchScript template takes ``*args, **kwargs``, which is what the methods here
take. TorchScript (``_module_interface_cls``) is accepted, but nothing here scripts
the local RemoteModule.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from ... import rpc
from ...rpc.serialization import SendState, register_reducer

__all__ = ["RemoteModule"]

logger = logging.getLogger(__name__)

_PARSE_ERROR = ("Could not parse remote_device: {}. The valid format is '<workername>/<device>' or "
                "'rank:<rank>/<device>' or '<device>'")

# What a RemoteModule sends inside an RPC, in this order; nn.Module's own state stays behind.
_PICKLED_ATTRIBUTES = ("on", "device", "is_device_map_set", "is_scriptable", "generated_methods", "module_rref")
_MODULE_STATE_ATTRIBUTES = frozenset(vars(nn.Module()))


def _parse_remote_device(remote_device: str | torch.device) -> tuple[str | int | None, torch.device]:
    """``"<worker>/<device>"``, ``"rank:<rank>/<device>"``, ``"<worker>"`` or ``"<device>"`` -> (worker, device).

    The worker is a name, a rank, or None (a local device only), as PyTorch's ``_remote_device`` parses it.
    """
    if isinstance(remote_device, torch.device):
        return None, remote_device
    if not isinstance(remote_device, str):
        raise TypeError(f"Invalid type for remote_device: {type(remote_device)}")
    fields = remote_device.split("/")
    if len(fields) == 2:
        worker, device = fields
    elif len(fields) == 1:
        try:
            return None, torch.device(fields[0])
        except (RuntimeError, ValueError):  # not a device: a worker name, on its cpu
            worker, device = fields[0], "cpu"
    else:
        raise ValueError(_PARSE_ERROR.format(remote_device))
    if not worker:
        raise ValueError(_PARSE_ERROR.format(remote_device))
    parsed_device = torch.device(device)  # torch's own error for a bad device string
    parts = worker.split(":")
    if len(parts) == 1:
        return worker, parsed_device
    if len(parts) == 2 and parts[0] == "rank" and parts[1].isdigit():
        return int(parts[1]), parsed_device
    raise ValueError(_PARSE_ERROR.format(remote_device))


def _raise_not_supported(name: str) -> None:
    raise ValueError(f"Method ``{name}`` not supported for RemoteModule")


def _not_supported(name: str) -> Callable[..., Any]:
    """An ``nn.Module`` method that a RemoteModule refuses: the module's state is on another worker."""

    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        _raise_not_supported(name)

    refused.__name__ = refused.__qualname__ = name
    return refused


# -- run on the module's owner -----------------------------------------------------------------
def _create_module(module_cls: Callable[..., nn.Module], args: tuple, kwargs: dict, device: str) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError("Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
                         f"but it returns an instance of {type(module)}.")
    module.to(device)
    return module


def _create_module_with_interface(module_cls: Callable[..., nn.Module], args: tuple, kwargs: dict, device: str,
                                  module_interface_cls: Any) -> rpc.RRef:
    module = torch.jit.script(_create_module(module_cls, args, kwargs, device))
    return rpc.RRef(module, module_interface_cls)


def _param_rrefs(module_rref: rpc.RRef, recurse: bool) -> list[rpc.RRef]:
    return [rpc.RRef(param) for param in module_rref.local_value().parameters(recurse)]


def _remote_forward(module_rref: rpc.RRef, device: str, is_device_map_set: bool, *args: Any, **kwargs: Any) -> Any:
    # Calls ``module.forward``, not ``module(...)``: the remote module's own hooks do not run (as in PyTorch).
    module = module_rref.local_value()
    target = torch.device(device)
    if target.type != "cuda":
        return module.forward(*args, **kwargs)
    args = tuple(arg.to(target) if isinstance(arg, torch.Tensor) else arg for arg in args)
    kwargs = {key: value.to(target) if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    if is_device_map_set:
        return module.forward(*args, **kwargs)
    # Without a device map only CPU tensors may travel back. PyTorch iterates over the output to move it, so
    # the reply is a tuple of its elements (a tensor's rows), not the output itself; kept for the same results.
    return tuple(out.cpu() if isinstance(out, torch.Tensor) else out for out in module.forward(*args, **kwargs))


# -- the module --------------------------------------------------------------------------------
class _RemoteModule(nn.Module):
    """:class:`RemoteModule`, plus PyTorch's experimental ``_module_interface_cls`` (a TorchScript interface:
    the remote module is scripted, and ``is_scriptable`` is True)."""

    def __init__(self, remote_device: str, module_cls: Callable[..., nn.Module], args: tuple | None = None,
                 kwargs: dict[str, Any] | None = None, _module_interface_cls: Any = None) -> None:
        super().__init__()
        self._prepare_init(remote_device)
        args = args if args is not None else ()
        kwargs = kwargs if kwargs is not None else {}
        self.is_scriptable = _module_interface_cls is not None
        self.generated_methods = _GENERATED_METHODS
        if _module_interface_cls is not None:
            self.module_rref = rpc.rpc_sync(self.on, _create_module_with_interface,
                                            (module_cls, args, kwargs, self.device, _module_interface_cls))
        else:
            # Asynchronous, as in PyTorch: a failing constructor raises at the first use of the module.
            self.module_rref = rpc.remote(self.on, _create_module, (module_cls, args, kwargs, self.device))

    def _prepare_init(self, remote_device: str) -> None:
        if not rpc.is_initialized():
            raise AssertionError("RemoteModule only works in RPC. Call torchdist.rpc.init_rpc first.")
        on, device = _parse_remote_device(remote_device)
        if on is None:
            raise TypeError(f"RemoteModule needs a worker in remote_device, got {remote_device!r} (a device only); "
                            "use '<workername>/<device>' or 'rank:<rank>/<device>'")
        rpc.get_worker_info(on)  # PyTorch's RuntimeError for an unknown worker, here rather than at first use
        self.on: str | int = on
        self.device = str(device)
        # torchdist's agent has no device maps: tensors come back on CPU.
        self.is_device_map_set = False

    # -- what runs remotely ----------------------------------------------------------------
    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future:
        """A Future of the remote module's ``forward(*args, **kwargs)``."""
        return rpc.rpc_async(self.module_rref.owner(), _remote_forward,
                             (self.module_rref, self.device, self.is_device_map_set, *args), kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The remote module's ``forward(*args, **kwargs)``; blocks."""
        return self.forward_async(*args, **kwargs).wait()

    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef]:
        """RRefs to the remote module's parameters (``DistributedOptimizer``'s input); ``recurse=False``: its
        direct parameters only."""
        return rpc.rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> rpc.RRef:
        """The RRef to the remote module."""
        return self.module_rref

    def train(self, mode: bool = True) -> nn.Module:
        """Put the remote module in training mode and return a copy of it; this RemoteModule is unchanged.

        ``mode`` is not passed on (as in PyTorch 2.13): ``train(False)`` also sets training mode.
        """
        return self.module_rref.rpc_sync().train()

    def eval(self) -> nn.Module:
        """Put the remote module in evaluation mode and return a copy of it."""
        return self.module_rref.rpc_sync().eval()

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: rpc.RRef,
                              _module_interface_cls: Any = None) -> "RemoteModule":
        """A RemoteModule over an existing remote module (several RemoteModules may share one module).

        ``remote_device`` should name ``module_rref``'s owner: ``forward`` goes to the owner,
        ``remote_parameters`` to ``remote_device``'s worker.
        """
        remote_module = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(remote_module)
        remote_module._prepare_init(remote_device)
        remote_module.is_scriptable = _module_interface_cls is not None
        remote_module.generated_methods = _GENERATED_METHODS
        remote_module.module_rref = module_rref
        return remote_module

    # -- pickling: only inside an RPC (see _reduce_remote_module) --------------------------
    def __getstate__(self) -> Any:
        raise RuntimeError("Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when "
                           "using RPC")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when "
                           "using RPC")

    # -- nn.Module methods that need the module here ---------------------------------------
    def parameters(self, recurse: bool = True) -> Any:
        raise ValueError("Method ``parameters`` not supported for RemoteModule. Please use ``remote_parameters`` "
                         "instead.")

    register_buffer = _not_supported("register_buffer")
    register_parameter = _not_supported("register_parameter")
    add_module = _not_supported("add_module")
    apply = _not_supported("apply")
    cuda = _not_supported("cuda")
    ipu = _not_supported("ipu")
    xpu = _not_supported("xpu")
    cpu = _not_supported("cpu")
    type = _not_supported("type")
    float = _not_supported("float")
    double = _not_supported("double")
    half = _not_supported("half")
    bfloat16 = _not_supported("bfloat16")
    to = _not_supported("to")
    register_backward_hook = _not_supported("register_backward_hook")
    register_forward_pre_hook = _not_supported("register_forward_pre_hook")
    register_forward_hook = _not_supported("register_forward_hook")
    state_dict = _not_supported("state_dict")
    load_state_dict = _not_supported("load_state_dict")
    named_parameters = _not_supported("named_parameters")
    buffers = _not_supported("buffers")
    named_buffers = _not_supported("named_buffers")
    children = _not_supported("children")
    named_children = _not_supported("named_children")
    modules = _not_supported("modules")
    named_modules = _not_supported("named_modules")
    requires_grad_ = _not_supported("requires_grad_")
    zero_grad = _not_supported("zero_grad")
    share_memory = _not_supported("share_memory")
    # nn.Module's __repr__ calls it: repr() of a RemoteModule raises too, as in PyTorch.
    extra_repr = _not_supported("extra_repr")


# PyTorch's ``generated_methods`` attribute: the functions its template made (by reference when pickled).
_GENERATED_METHODS = [_RemoteModule.forward_async, _RemoteModule.forward]


class RemoteModule(_RemoteModule):
    """An ``nn.Module`` created by ``module_cls(*args, **kwargs)`` on the worker named by ``remote_device``.

    ``remote_device``: ``"<workername>/<device>"`` (``"trainer0/cpu"``), ``"rank:<rank>/<device>"``
    (``"rank:1/cpu"``) or ``"<workername>"`` (on its cpu). Create it after ``rpc.init_rpc``.
    ``forward``/``forward_async`` take the remote module's ``forward`` arguments.
    """

    def __init__(self, remote_device: str, module_cls: Callable[..., nn.Module], args: tuple | None = None,
                 kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(remote_device, module_cls, args, kwargs)


# -- pickling inside RPC -----------------------------------------------------------------------
def _reduce_remote_module(state: SendState, remote_module: RemoteModule) -> tuple:
    """Send the attributes that say where the module is; the RRef's own reducer forks it for the receiver."""
    attributes = vars(remote_module)
    for name in attributes:
        if name not in _PICKLED_ATTRIBUTES and name not in _MODULE_STATE_ATTRIBUTES:
            logger.warning("RemoteModule attribute %r is not sent over RPC: only %s are", name,
                           ", ".join(_PICKLED_ATTRIBUTES))
    return (_rebuild_remote_module, tuple(attributes[name] for name in _PICKLED_ATTRIBUTES))


def _rebuild_remote_module(*values: Any) -> RemoteModule:
    # A full nn.Module (PyTorch's receiver skips nn.Module.__init__, so that calling it fails): ``module(x)``
    # and ``training`` work on the receiver too.
    remote_module = RemoteModule.__new__(RemoteModule)
    nn.Module.__init__(remote_module)
    for name, value in zip(_PICKLED_ATTRIBUTES, values):
        setattr(remote_module, name, value)
    return remote_module


register_reducer(RemoteModule, _reduce_remote_module)
