"""The rendezvous interface: how the agents of a job agree on who takes part in a round.

A *node* is one agent (one launcher process) and its local workers. A *round* is
one agreement: a list of participating nodes, in group-rank order. The agents
start their workers after a round forms, and form a new round when the worker
group must restart (a failure, a node that joined or left).

::

    RendezvousError                 anything that went wrong in a rendezvous
     ├── RendezvousTimeoutError     the round did not form within ``join_timeout``
     ├── RendezvousClosedError      the job finished (or was closed); a late node leaves
     ├── RendezvousConnectionError  the rendezvous store cannot be reached any more
     ├── RendezvousStateError       the store holds something this protocol did not write
     └── RendezvousGracefulExitError   a node was told to leave without an error

:class:`RendezvousParameters` is torchrun's free-form description (backend, endpoint,
run id, node counts, ``--rdzv-conf`` pairs); :class:`RendezvousSettings` is the
same parsed once into typed, validated values.
"""

from __future__ import annotations

import abc
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ClassVar

from ..._store.base import Store

__all__ = [
    "RendezvousError",
    "RendezvousTimeoutError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousStateError",
    "RendezvousGracefulExitError",
    "RendezvousParameters",
    "RendezvousSettings",
    "NodeDesc",
    "RendezvousInfo",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousStoreInfo",
    "rendezvous_handler_registry",
]


class RendezvousError(Exception):
    """Base of every rendezvous error."""


class RendezvousTimeoutError(RendezvousError):
    """Not enough nodes joined the round in time."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous was closed: the job finished or was shut down."""


class RendezvousConnectionError(RendezvousError):
    """The rendezvous store is unreachable (its host node may have died)."""


class RendezvousStateError(RendezvousError):
    """The rendezvous state in the store is not what this protocol wrote."""


class RendezvousGracefulExitError(RendezvousError):
    """This node should exit without error (it is not needed in the job)."""


_TRUE = {"1", "true", "t", "yes", "y"}
_FALSE = {"0", "false", "f", "no", "n"}


class RendezvousParameters:
    """torchrun's rendezvous description; ``config`` holds the ``--rdzv-conf`` pairs.

    As torch's, extra keyword arguments are configuration too:
    ``RendezvousParameters("c10d", "host:29400", "job", 1, 2, join_timeout="60")``.
    """

    def __init__(self, backend: str, endpoint: str, run_id: str, min_nodes: int, max_nodes: int,
                 local_addr: str | None = None, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        if min_nodes < 1:
            raise ValueError(f"The minimum number of rendezvous nodes ({min_nodes}) must be greater than zero.")
        if max_nodes < min_nodes:
            raise ValueError(
                f"The maximum number of rendezvous nodes ({max_nodes}) must be greater than or equal to "
                f"the minimum number of rendezvous nodes ({min_nodes})."
            )
        self.backend, self.endpoint, self.run_id = backend, endpoint, run_id
        self.min_nodes, self.max_nodes, self.local_addr = min_nodes, max_nodes, local_addr
        self.config: dict[str, Any] = {**(config or {}), **kwargs}

    def __repr__(self) -> str:
        return (f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, run_id={self.run_id!r}, "
                f"min_nodes={self.min_nodes}, max_nodes={self.max_nodes}, local_addr={self.local_addr!r})")

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(
            f"The rendezvous configuration option '{key}' does not represent a valid boolean value: {value!r}"
        )

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key, default)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise ValueError(
                f"The rendezvous configuration option '{key}' does not represent a valid integer value: {value!r}"
            ) from None

    def get_as_float(self, key: str, default: float) -> float:
        value = self.get(key, default)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"The rendezvous configuration option '{key}' is not a number: {value!r}") from None


@dataclass(frozen=True, kw_only=True)
class RendezvousSettings:
    """The timing of a store-based rendezvous, all in seconds (torchrun's ``--rdzv-conf`` keys)."""

    join_timeout: float = 600.0  # a round must form within this (``timeout`` or ``join_timeout``)
    last_call_timeout: float = 30.0  # once ``min_nodes`` joined, wait this long for more
    close_timeout: float = 30.0  # the exit barrier: how long a finished node waits for the others
    read_timeout: float = 60.0  # one store operation
    keep_alive_interval: float = 5.0  # a node's heartbeat period
    keep_alive_max_attempt: int = 3  # heartbeats missed before a node counts as lost
    is_host: bool | None = None  # host the store? ``None``: when the endpoint is a local address

    def __post_init__(self) -> None:
        for name in ("join_timeout", "last_call_timeout", "close_timeout", "read_timeout", "keep_alive_interval"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"rendezvous setting {name} must be a positive number of seconds, got {value!r}")
        if self.keep_alive_max_attempt < 1:
            raise ValueError(
                f"rendezvous setting keep_alive_max_attempt must be >= 1, got {self.keep_alive_max_attempt}"
            )

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> "RendezvousSettings":
        join = params.get("join_timeout", params.get("timeout", cls.join_timeout))
        return cls(
            join_timeout=_seconds(join, "join_timeout"),
            last_call_timeout=params.get_as_float("last_call_timeout", cls.last_call_timeout),
            close_timeout=params.get_as_float("close_timeout", cls.close_timeout),
            read_timeout=params.get_as_float("read_timeout", cls.read_timeout),
            keep_alive_interval=params.get_as_float("keep_alive_interval", cls.keep_alive_interval),
            keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", cls.keep_alive_max_attempt),
            is_host=params.get_as_bool("is_host", None),
        )

    @property
    def lost_after(self) -> float:
        """Seconds without a heartbeat after which a node counts as lost."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"The rendezvous configuration option '{name}' is not a number of seconds: {value!r}"
        ) from None


@dataclass(frozen=True)
class NodeDesc:
    """One participant of a round: a unique id, its host for messages, its number of workers."""

    node_id: str
    host: str
    local_world_size: int
    node_rank: int = -1  # the static backend's fixed rank; -1 for the dynamic one


@dataclass(frozen=True)
class RendezvousStoreInfo:
    """Where the workers' store (the agent store) is: ``MASTER_ADDR`` and ``MASTER_PORT``."""

    MASTER_ADDR_KEY: ClassVar[str] = "MASTER_ADDR"
    MASTER_PORT_KEY: ClassVar[str] = "MASTER_PORT"
    master_addr: str
    master_port: int

    @staticmethod
    def build(rank: int, store: Store, local_addr: str | None, server_port: int | None = None
              ) -> "RendezvousStoreInfo":
        """Rank 0 publishes its address (and ``server_port``, else a free port) in ``store``; every rank reads it."""
        if rank == 0:
            port = server_port or _free_port()
            store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, (local_addr or socket.getfqdn()).encode())
            store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(port).encode())
        addr = store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
        return RendezvousStoreInfo(addr, int(store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode()))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class RendezvousInfo:
    """A formed round, as one node sees it (torch's fields, plus the round's participants).

    ``rank`` is this node's group rank and ``world_size`` the number of nodes (torch's
    meaning); ``participants`` (torchdist's backends fill it) give each node's number of
    workers, from which :attr:`rank_offset` and :attr:`num_workers` follow.
    """

    def __init__(self, store: Store, rank: int, world_size: int,
                 bootstrap_store_info: RendezvousStoreInfo | None = None, *, round: int = 0,
                 participants: tuple[NodeDesc, ...] = ()) -> None:
        if participants and len(participants) != world_size:
            raise ValueError(f"RendezvousInfo: {len(participants)} participants for world_size {world_size}")
        self._store, self._rank, self._world_size = store, rank, world_size
        self._bootstrap_store_info = bootstrap_store_info
        self.round = round
        self.participants = tuple(participants)

    @property
    def store(self) -> Store:
        """The store the workers share (the agent store)."""
        return self._store

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def bootstrap_store_info(self) -> RendezvousStoreInfo | None:
        return self._bootstrap_store_info

    # -- torchdist's names -----------------------------------------------------------
    @property
    def group_rank(self) -> int:
        return self._rank

    @property
    def group_world_size(self) -> int:
        return self._world_size

    @property
    def master_addr(self) -> str:
        return self._bootstrap_store_info.master_addr if self._bootstrap_store_info else ""

    @property
    def master_port(self) -> int:
        return self._bootstrap_store_info.master_port if self._bootstrap_store_info else 0

    def rank_offset(self, local_world_size: int) -> int:
        """The global rank of this node's local rank 0 (every node runs ``local_world_size`` without participants)."""
        if not self.participants:
            return self._rank * local_world_size
        return sum(node.local_world_size for node in self.participants[: self._rank])

    def num_workers(self, local_world_size: int) -> int:
        """Workers in the whole round (``world_size * local_world_size`` without participants)."""
        if not self.participants:
            return self._world_size * local_world_size
        return sum(node.local_world_size for node in self.participants)


class RendezvousHandler(abc.ABC):
    """What the agent needs from a rendezvous backend: torch's interface, plus coordination calls.

    The coordination calls (lost nodes, restart requests, failure reports, the exit
    barrier) have do-nothing defaults, so a handler written for torch's interface only
    (``next_rendezvous()`` with no argument included) works under the agent too.
    """

    @abc.abstractmethod
    def get_backend(self) -> str: ...

    @abc.abstractmethod
    def get_run_id(self) -> str: ...

    @abc.abstractmethod
    def next_rendezvous(self, local_world_size: int) -> RendezvousInfo:
        """Join the next round with this node's ``local_world_size`` workers; block until it forms.

        Raises a :class:`RendezvousError`. (torch's takes no argument; the agent accepts both.)
        """

    def num_nodes_waiting(self) -> int:
        """Nodes that arrived after the current round formed and could still join (room below max)."""
        return 0

    def lost_nodes(self) -> list[str]:
        """Participants of the current round that left or stopped sending heartbeats."""
        return []

    def request_restart(self, reason: str) -> None:
        """Ask every node of the current round to stop its workers and form a new round."""
        return None

    def restart_request(self) -> dict | None:
        """The restart some node asked for in the current round, if any: ``{"reason", "node"}``."""
        return None

    def report_failure(self, summary: dict) -> None:
        """Tell the other nodes that the job failed for good (``summary`` names the root cause)."""
        return None

    def job_failure(self) -> dict | None:
        """The failure some node reported, if any."""
        return None

    def exit_barrier(self, timeout: float | None = None) -> None:
        """This node's workers succeeded: wait for the other nodes, then close the rendezvous."""
        return None

    @abc.abstractmethod
    def is_closed(self) -> bool: ...

    @abc.abstractmethod
    def set_closed(self) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> bool:
        """Leave (announcing it) and release the store; True if it went cleanly."""

    @property
    def use_agent_store(self) -> bool:
        return True

    @property
    def max_nodes(self) -> int:
        """The most nodes a round may have (1: a single-node job, no membership changes to watch)."""
        return 2**31 - 1


RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]


class RendezvousHandlerRegistry:
    """Backend name -> the function that creates its handler from :class:`RendezvousParameters`."""

    def __init__(self) -> None:
        self._registry: dict[str, RendezvousHandlerCreator] = {}

    def register(self, backend: str, creator: RendezvousHandlerCreator) -> None:
        """Add ``backend``; registering it again with another creator is an error."""
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        current = self._registry.get(backend)
        if current is not None and current is not creator:
            raise ValueError(f"The rendezvous backend '{backend}' cannot be registered with '{creator}' as it is "
                             f"already registered with '{current}'.")
        self._registry[backend] = creator

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """A new handler of ``params.backend``; ValueError naming the known backends if it is not registered."""
        creator = self._registry.get(params.backend)
        if creator is None:
            raise ValueError(
                f"The rendezvous backend '{params.backend}' is not registered. Did you forget to call "
                f"`register`? Known backends: {sorted(self._registry)}"
            )
        handler = creator(params)
        if handler.get_backend() != params.backend:
            raise RuntimeError(f"The rendezvous backend '{handler.get_backend()}' does not match the requested "
                               f"backend '{params.backend}'.")
        return handler

    def __contains__(self, backend: object) -> bool:
        return backend in self._registry

    def backends(self) -> list[str]:
        return sorted(self._registry)


#: The process's registry; ``rendezvous/__init__.py`` registers ``c10d`` and ``static``.
rendezvous_handler_registry = RendezvousHandlerRegistry()
