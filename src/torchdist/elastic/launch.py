"""Launch one node's workers from a :class:`LaunchConfig`: build the rendezvous and the agent, run, report.

``launch_agent(config, entrypoint, args)`` is what ``torchdist-run`` calls;
``elastic_launch(config, entrypoint)(*args)`` is torch's spelling of the same. The
entrypoint is an executable or, as in torch, a picklable Python function (run by
:mod:`~torchdist.elastic.function_worker`). Both return ``{global rank: return
value}`` (``None`` per rank for executables) and raise
:class:`~torchdist.elastic.multiprocessing.errors.ChildFailedError` when the job failed.

The job secret (:mod:`torchdist._auth`) is decided here, once:

1. ``config.secret`` when given (``torchdist-run --secret-file``), else
2. ``$TORCHDIST_SECRET`` when set (an empty value turns authentication off), else
3. a fresh random secret when the job runs on one node only (``max_nodes == 1``), else
4. none, with a warning: the nodes of a multi-node job cannot agree on a random
   secret, so the user must set one (docs/launcher.md says how).

The secret protects the rendezvous store, which is also the workers' store, and is
handed to the workers as ``TORCHDIST_SECRET``.
"""

from __future__ import annotations

import logging
import multiprocessing.spawn
import os
import pickle
import shutil
import sys
import tempfile
from typing import Any, Callable

from .._auth import SECRET_ENV, new_secret, resolve_secret
from .agent.server import LocalElasticAgent, WorkerSpec, WorkerState
from .config import LaunchConfig
from .multiprocessing.api import DefaultLogsSpecs
from .multiprocessing.errors import ChildFailedError
from .rendezvous import RendezvousParameters, get_rendezvous_handler

__all__ = ["launch_agent", "elastic_launch", "job_secret"]

log = logging.getLogger(__name__)


def job_secret(config: LaunchConfig) -> str | None:
    """The secret of this job, by the rules in the module docstring."""
    if config.secret is not None:
        return config.secret or None
    if SECRET_ENV in os.environ:
        secret = resolve_secret()
        return secret.decode("utf-8", "surrogateescape") if secret else None
    if not config.is_multi_node:
        return new_secret()
    log.warning(
        "multi-node job without a job secret: the rendezvous store at %s accepts connections from anyone "
        "who can reach it. Set the same %s on every node (see docs/launcher.md) to require authentication.",
        config.rdzv_endpoint, SECRET_ENV,
    )
    return None


def launch_agent(config: LaunchConfig, entrypoint: str | Callable, args: list[Any],
                 name: str | None = None) -> dict[int, Any]:
    """Run ``entrypoint args...`` (or ``entrypoint(*args)``) as ``config.nproc_per_node`` workers on
    this node, as part of the job."""
    if callable(entrypoint):
        return _launch_function(config, entrypoint, args)
    secret = job_secret(config)
    rdzv_configs = dict(config.rdzv_configs)
    if secret:
        rdzv_configs["secret"] = secret
    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr, config=rdzv_configs,
    )
    log.info(
        "Starting elastic_operator with launch configs:\n  entrypoint       : %s\n  min_nodes        : %d\n"
        "  max_nodes        : %d\n  nproc_per_node   : %d\n  run_id           : %s\n  rdzv_backend     : %s\n"
        "  rdzv_endpoint    : %s\n  max_restarts     : %d\n  monitor_interval : %s\n  log_dir          : %s\n"
        "  authenticated    : %s",
        name or entrypoint, config.min_nodes, config.max_nodes, config.nproc_per_node, config.run_id,
        config.rdzv_backend, config.rdzv_endpoint, config.max_restarts, config.monitor_interval, config.log_dir,
        bool(secret),
    )
    handler = get_rendezvous_handler(params)
    try:
        logs_specs = DefaultLogsSpecs(log_dir=config.log_dir, redirects=config.redirects, tee=config.tee,
                                      local_ranks_filter=config.local_ranks_filter)
        spec = WorkerSpec(
            role=config.role, local_world_size=config.nproc_per_node, rdzv_handler=handler, entrypoint=entrypoint,
            args=tuple(args), max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
            local_addr=config.local_addr, duplicate_stdout_filters=list(config.duplicate_stdout_filters),
            duplicate_stderr_filters=list(config.duplicate_stderr_filters),
            virtual_local_rank=config.virtual_local_rank,
        )
        agent = LocalElasticAgent(
            spec, logs_specs, exit_barrier_timeout=config.exit_barrier_timeout,
            log_line_prefix_template=config.log_line_prefix_template, shutdown_timeout=config.shutdown_timeout,
            extra_env={SECRET_ENV: secret} if secret else {SECRET_ENV: ""},
            signals_to_handle=config.signals_to_handle,
        )
        result = agent.run()
    finally:
        handler.shutdown()
    if result.is_failed():
        raise ChildFailedError(name or _entrypoint_name(entrypoint, args), result.failures, result.hosts, result.note)
    if logs_specs.owns_root and result.state == WorkerState.SUCCEEDED:
        # Without --log-dir, logs and error files went to a temp dir: kept only when the run failed.
        shutil.rmtree(logs_specs.root_log_dir, ignore_errors=True)
    return result.return_values


def _entrypoint_name(entrypoint: str, args: list[Any]) -> str:
    """torch's name for a failed job: the script for ``python script ...``, else the executable."""
    if entrypoint == sys.executable:
        return next((str(arg) for arg in args if not str(arg).startswith("-")), "")
    return entrypoint


def _launch_function(config: LaunchConfig, function: Callable, args: list[Any]) -> dict[int, Any]:
    """``function(*args)`` on every worker; their return values, by global rank."""
    with tempfile.TemporaryDirectory(prefix="torchdist-function-") as tmp:
        call = os.path.join(tmp, "call.pkl")
        preparation = multiprocessing.spawn.get_preparation_data(function.__qualname__)
        preparation.pop("authkey", None)  # multiprocessing's own connections' key: not ours to send
        with open(call, "wb") as f:
            pickle.dump(preparation, f)
            pickle.dump((function, tuple(args)), f)
        ranks = launch_agent(config, sys.executable, ["-u", "-m", "torchdist.elastic.function_worker", call, tmp],
                             name=function.__qualname__)
        values = {}
        for rank in ranks:
            with open(os.path.join(tmp, f"{rank}.pkl"), "rb") as f:
                values[rank] = pickle.load(f)
        return values


class elastic_launch:  # noqa: N801 - torch's name
    """``elastic_launch(config, entrypoint)(*args)``: :func:`launch_agent` with torch's calling convention.

    ``entrypoint`` is an executable (e.g. ``sys.executable``) and ``args`` its arguments
    (made strings), or a picklable function and the arguments of its call.
    """

    def __init__(self, config: LaunchConfig, entrypoint: str | Callable) -> None:
        if not isinstance(entrypoint, str) and not callable(entrypoint):
            raise TypeError(f"elastic_launch: the entrypoint must be an executable's path or a function, got "
                            f"{type(entrypoint).__name__}")
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        if callable(self._entrypoint):
            return launch_agent(self._config, self._entrypoint, list(args))
        return launch_agent(self._config, self._entrypoint, [str(a) for a in args])
