"""Rendezvous: turn an ``init_method`` URL into a store that every rank shares.

``rendezvous(url, rank, world_size, timeout=...)`` yields ``(store, rank, world_size)``,
PyTorch's generator protocol, with one handler per URL scheme:

=============  =====================================================================
``env://``      a TCPStore at ``MASTER_ADDR:MASTER_PORT``; rank 0 hosts it. ``RANK`` and
                ``WORLD_SIZE`` come from the environment unless given as arguments.
``tcp://h:p``   a TCPStore at ``h:p``; rank and world size from the arguments or the
                query string (``?rank=0&world_size=2``).
``file:///p``   a FileStore on path ``p`` shared by all ranks (a shared filesystem).
=============  =====================================================================

Under an elastic launcher (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank is a
client of the store the agent already hosts. ``register_rendezvous_handler`` adds
schemes.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable, Iterator
from urllib.parse import parse_qs, urlparse

from .base import DEFAULT_STORE_TIMEOUT, Store
from .file_store import FileStore
from .tcp_store import TCPStore

__all__ = ["rendezvous", "register_rendezvous_handler"]

RendezvousHandler = Callable[..., Iterator[tuple[Store, int, int]]]
_handlers: dict[str, RendezvousHandler] = {}


def register_rendezvous_handler(scheme: str, handler: RendezvousHandler) -> None:
    """Add a handler ``handler(url, **kwargs)`` yielding ``(store, rank, world_size)``."""
    if scheme in _handlers:
        raise RuntimeError(f"Rendezvous handler for {scheme}:// already registered")
    _handlers[scheme] = handler


def rendezvous(url: str, rank: int = -1, world_size: int = -1, **kwargs) -> Iterator[tuple[Store, int, int]]:
    """Find the handler for ``url``'s scheme and return its generator."""
    if not isinstance(url, str):
        raise RuntimeError(f"`url` must be a string. {type(url)}: {url}")
    if not isinstance(rank, int) or not isinstance(world_size, int):
        raise RuntimeError(f"`rank` and `world_size` must be integers, got {rank!r}, {world_size!r}")
    parsed = urlparse(url)
    if rank != -1 or world_size != -1:
        query = parse_qs(parsed.query)
        # As in PyTorch: node-specific values may come from the URL or the arguments, not both.
        assert "rank" not in query and "world_size" not in query, (
            f"The url: {url} has node-specific arguments(rank, world_size) already."
        )
        extra = []
        if rank != -1:
            extra.append(f"rank={rank}")
        if world_size != -1:
            extra.append(f"world_size={world_size}")
        if extra:
            query_string = "&".join(filter(None, [parsed.query, *extra]))
            url = parsed._replace(query=query_string).geturl()
            parsed = urlparse(url)
    handler = _handlers.get(parsed.scheme)
    if handler is None:
        raise RuntimeError(f"No rendezvous handler for {parsed.scheme}://")
    return handler(url, **kwargs)


def _query_int(url: str, name: str, missing: str) -> int:
    values = parse_qs(urlparse(url).query).get(name)
    if not values:
        raise ValueError(f"Error initializing torchdist using {url}: {missing} parameter missing")
    try:
        return int(values[0])
    except ValueError:
        raise ValueError(f"Error initializing torchdist using {url}: {name}={values[0]!r} is not an integer") from None


def _not_set(name: str) -> ValueError:
    return ValueError(
        f"Error initializing torchdist using env:// rendezvous: environment variable {name} expected, "
        "but not set. Set it, pass it to init_process_group, or launch with torchdist-run."
    )


def _env_int(name: str, given: int) -> int:
    if given != -1:
        return given
    value = os.environ.get(name)
    if value is None:
        raise _not_set(name)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"env:// rendezvous: environment variable {name}={value!r} is not an integer") from None


def _check_rank(rank: int, world_size: int, url: str) -> None:
    if world_size <= 0:
        raise ValueError(f"Error initializing torchdist using {url}: world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"Error initializing torchdist using {url}: rank {rank} is out of range for world_size "
            f"{world_size} (ranks are 0..{world_size - 1})"
        )


def _tcp_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> TCPStore:
    """Rank 0 hosts the server, unless an elastic agent already hosts one for the job."""
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return TCPStore(
        host,
        port,
        world_size,
        is_master=(rank == 0 and not agent_hosts_store),
        timeout=timeout,
        multi_tenant=True,
    )


def _tcp_rendezvous_handler(url: str, timeout: timedelta = DEFAULT_STORE_TIMEOUT, **kwargs) -> Iterator:
    parsed = urlparse(url)
    if not parsed.port:
        raise ValueError(f"Error initializing torchdist using {url}: port number missing")
    rank = _query_int(url, "rank", "rank")
    world_size = _query_int(url, "world_size", "world size")
    _check_rank(rank, world_size, url)
    store = _tcp_store(parsed.hostname, parsed.port, rank, world_size, timeout)
    yield store, rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using tcp:// method")


def _env_rendezvous_handler(url: str, timeout: timedelta = DEFAULT_STORE_TIMEOUT, **kwargs) -> Iterator:
    query = parse_qs(urlparse(url).query)
    rank = _env_int("RANK", int(query["rank"][0]) if "rank" in query else -1)
    world_size = _env_int("WORLD_SIZE", int(query["world_size"][0]) if "world_size" in query else -1)
    addr = os.environ.get("MASTER_ADDR")
    if not addr:  # (an empty one too: it would only fail at the timeout)
        raise _not_set("MASTER_ADDR")
    port = _env_int("MASTER_PORT", -1)
    _check_rank(rank, world_size, url)
    store = _tcp_store(addr, port, rank, world_size, timeout)
    yield store, rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


def _file_rendezvous_handler(url: str, timeout: timedelta = DEFAULT_STORE_TIMEOUT, **kwargs) -> Iterator:
    parsed = urlparse(url)
    path = parsed.path or parsed.netloc
    if not path:
        raise ValueError(f"Error initializing torchdist using {url}: path missing")
    rank = _query_int(url, "rank", "rank")
    world_size = _query_int(url, "world_size", "world size")
    _check_rank(rank, world_size, url)
    store = FileStore(path, world_size)
    store.set_timeout(timeout)
    yield store, rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using file:// method")


register_rendezvous_handler("tcp", _tcp_rendezvous_handler)
register_rendezvous_handler("env", _env_rendezvous_handler)
register_rendezvous_handler("file", _file_rendezvous_handler)
