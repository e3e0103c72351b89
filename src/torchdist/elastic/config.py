"""The launcher's configuration: one frozen, validated :class:`LaunchConfig` per launch.

``torchdist-run`` parses its flags (and ``PET_*`` variables) into a LaunchConfig;
``elastic_launch(config, entrypoint)`` takes one directly, as torch's does. Every
field is checked in ``__post_init__``; an error names the field, the value and
what is allowed. Vocabulary: a *node* is one launcher (agent); *local* means
"on this node"; ``nproc_per_node`` workers run on each node.
"""

from __future__ import annotations

import os
import signal
import uuid
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from .multiprocessing.api import Std

__all__ = ["LaunchConfig", "parse_min_max_nnodes", "parse_nproc_per_node", "parse_rdzv_conf", "parse_signals"]

_START_METHODS = ("spawn", "fork", "forkserver")


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    """``"2"`` -> ``(2, 2)``; ``"1:4"`` -> ``(1, 4)``."""
    parts = str(nnodes).split(":")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise ValueError(f'nnodes={nnodes} is not in "MIN:MAX" or "N" format')


def parse_nproc_per_node(value: str) -> int:
    """An integer, or ``cpu``/``auto`` (this machine's CPU count; torch builds without GPUs).

    ``gpu`` and ``xpu`` need an accelerator, which torchdist's CPU backends do not use.
    """
    text = str(value).strip()
    if text.isdigit():
        return int(text)
    if text in ("cpu", "auto"):
        return os.cpu_count() or 1
    if text in ("gpu", "xpu"):
        raise ValueError(f"--nproc-per-node={text}: torchdist runs CPU workers; give a number, 'cpu' or 'auto'")
    raise ValueError(f"Unsupported nproc_per_node value: {value!r} (an integer, 'cpu' or 'auto')")


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``"k1=v1,k2=v2"`` -> ``{"k1": "v1", "k2": "v2"}``."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--rdzv-conf: {item!r} is not key=value (the whole value was {text!r})")
        conf[key.strip()] = value.strip()
    return conf


def parse_signals(text: str) -> tuple[int, ...]:
    """``"SIGTERM,SIGINT"`` -> the signal numbers; unknown names are an error."""
    result = []
    for name in filter(None, (part.strip() for part in text.split(","))):
        try:
            result.append(int(getattr(signal.Signals, name)))
        except AttributeError:
            raise ValueError(f"--signals-to-handle: unknown signal {name!r}") from None
    return tuple(result)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What to launch on this node and how the nodes meet (torch's ``LaunchConfig``, validated).

    ``redirects`` / ``tee`` take a :class:`Std` or a per-local-rank mapping.
    ``secret`` authenticates every connection to the rendezvous store; it is never
    shown in ``repr``.
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    run_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    role: str = "default_role"  # torch's LaunchConfig default (torchrun's --role default is "default")
    rdzv_endpoint: str = ""
    rdzv_backend: str = "static"
    rdzv_configs: Mapping[str, object] = field(default_factory=dict)
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: Std | Mapping[int, Std] = Std.NONE
    tee: Std | Mapping[int, Std] = Std.NONE
    local_ranks_filter: frozenset[int] | None = None
    local_addr: str | None = None
    shutdown_timeout: float = 30.0
    exit_barrier_timeout: float = 300.0
    #: signal numbers, or torch's form: names in a string ("SIGTERM,SIGINT")
    signals_to_handle: tuple[int, ...] | str = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    log_line_prefix_template: str | None = None
    secret: str | None = field(default=None, repr=False)
    #: Lines of a tee'd stream containing one of these also go to the attempt's
    #: filtered_stdout.log / filtered_stderr.log (torchrun's --duplicate-*-filters).
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    #: Every worker sees LOCAL_RANK=0 (torchrun's --virtual-local-rank).
    virtual_local_rank: bool = False

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be >= 1, got {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if not self.run_id:
            raise ValueError("run_id must be a non-empty string")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.monitor_interval > 0:
            raise ValueError(f"monitor_interval must be > 0 seconds, got {self.monitor_interval}")
        if self.start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {self.start_method!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if not self.role:
            raise ValueError("role must be a non-empty string")
        if isinstance(self.signals_to_handle, str):
            object.__setattr__(self, "signals_to_handle", parse_signals(self.signals_to_handle))
        for name in ("redirects", "tee"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                bad = [r for r in value if not 0 <= r < self.nproc_per_node]
                if bad:
                    raise ValueError(f"{name}: local ranks {bad} are outside 0..{self.nproc_per_node - 1}")
                object.__setattr__(self, name, MappingProxyType({int(r): Std(s) for r, s in value.items()}))
            else:
                object.__setattr__(self, name, Std(value))
        object.__setattr__(self, "rdzv_configs", MappingProxyType(dict(self.rdzv_configs)))
        if self.local_ranks_filter is not None:
            object.__setattr__(self, "local_ranks_filter", frozenset(self.local_ranks_filter))

    @property
    def is_multi_node(self) -> bool:
        return self.max_nodes > 1
