"""Rendezvous backends: how the agents of a job agree on a round (torch.distributed.elastic.rendezvous).

Two backends ship, both rounds over a TCPStore that one agent hosts (see
:mod:`.store_rendezvous`): ``c10d`` (dynamic: ``MIN:MAX`` nodes, joins and losses
start a new round) and ``static`` (a fixed number of nodes with fixed ranks from
``--node-rank``). ``rendezvous_handler_registry.create_handler(params)`` (or
:func:`.registry.get_rendezvous_handler`) builds the handler for ``params.backend``;
``rendezvous_handler_registry.register(name, creator)`` (or ``register_rendezvous_handler``) adds a backend.
"""

from __future__ import annotations

from .api import (
    NodeDesc,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousHandlerCreator,
    RendezvousHandlerRegistry,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousSettings,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from .store_rendezvous import StoreRendezvousHandler

__all__ = [
    "NodeDesc",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousSettings",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeoutError",
    "StoreRendezvousHandler",
    "get_rendezvous_handler",
    "parse_endpoint",
    "register_rendezvous_handler",
    "rendezvous_handler_registry",
]

#: torchrun's default port of the c10d rendezvous endpoint.
DEFAULT_C10D_PORT = 29400


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``"host:port"``, ``"host"`` or ``"[v6]:port"`` -> ``(host, port)``."""
    endpoint = endpoint.strip()
    if not endpoint:
        raise ValueError("the rendezvous endpoint is empty: give --rdzv-endpoint host:port")
    if endpoint.startswith("["):
        host, _, rest = endpoint[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif endpoint.count(":") == 1:
        host, _, port_text = endpoint.partition(":")
    else:
        host, port_text = endpoint, ""
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise ValueError(f"the port of the rendezvous endpoint {endpoint!r} is not an integer") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"the port of the rendezvous endpoint {endpoint!r} is outside 0..65535")
    return host, port


def _create_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_endpoint(params.endpoint, DEFAULT_C10D_PORT)
    return StoreRendezvousHandler(
        backend="c10d", run_id=params.run_id, host=host, port=port, min_nodes=params.min_nodes,
        max_nodes=params.max_nodes, settings=RendezvousSettings.from_parameters(params),
        local_addr=params.local_addr, secret=params.get("secret"),
    )


def _create_static_handler(params: RendezvousParameters) -> RendezvousHandler:
    rank = params.get_as_int("rank")
    if rank is None:
        raise ValueError("the static rendezvous needs this node's rank (--node-rank)")
    host, port = parse_endpoint(params.endpoint, DEFAULT_C10D_PORT)
    return StoreRendezvousHandler(
        backend="static", run_id=params.run_id, host=host, port=port, min_nodes=params.min_nodes,
        max_nodes=params.max_nodes, settings=RendezvousSettings.from_parameters(params),
        local_addr=params.local_addr, node_rank=rank, secret=params.get("secret"),
    )


def register_rendezvous_handler(backend: str, creator: RendezvousHandlerCreator) -> None:
    """Add a backend to ``rendezvous_handler_registry``; registering a name twice is an error."""
    if backend in rendezvous_handler_registry:
        raise ValueError(f"The rendezvous backend '{backend}' cannot be registered twice.")
    rendezvous_handler_registry.register(backend, creator)


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """A new handler of ``params.backend`` (torch's ``rendezvous.registry.get_rendezvous_handler``)."""
    return rendezvous_handler_registry.create_handler(params)


register_rendezvous_handler("c10d", _create_c10d_handler)
register_rendezvous_handler("static", _create_static_handler)
