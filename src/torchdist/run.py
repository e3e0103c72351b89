"""``torchdist-run`` / ``python -m torchdist.run``: torchrun's command line, on torchdist's elastic agent.

::

    torchdist-run --nproc-per-node 4 train.py --lr 0.1             # one node
    torchdist-run --standalone --nproc-per-node cpu train.py       # one node, a free port
    torchdist-run --nnodes 2 --node-rank 0 --master-addr n0 --master-port 29500 --nproc-per-node 8 train.py
    torchdist-run --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint n0:29400 --rdzv-id job7 train.py

Every flag has torchrun's meaning and default, accepts the underscore spelling
(``--nproc_per_node``) and can come from ``PET_<FLAG>`` (``PET_NPROC_PER_NODE=4``).
One flag is torchdist's own: ``--secret-file PATH`` reads the job secret from a file
(see :mod:`torchdist.elastic.launch` and docs/launcher.md). Workers get torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), so
``torchdist.init_process_group()`` needs no arguments. On failure the launcher
prints torchrun's summary (the first failed rank, its exit code or signal, host,
time and traceback) and exits 1; stopped by a signal, it stops the workers and exits 1, as torchrun does.

This module parses and reports only; the work is in :mod:`torchdist.elastic`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from argparse import REMAINDER, Action, ArgumentParser

from .elastic.config import LaunchConfig, parse_min_max_nnodes, parse_nproc_per_node, parse_rdzv_conf, parse_signals
from .elastic.launch import launch_agent
from .elastic.multiprocessing.api import SignalException, Std
from .elastic.multiprocessing.errors import ChildFailedError, get_error_handler, record
from .elastic.rendezvous import RendezvousError

__all__ = ["main", "get_args_parser", "parse_args", "config_from_args", "run"]

log = logging.getLogger("torchdist.run")

_OMP_NOTICE = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system "
    "being overloaded, please further tune the variable for optimal performance in your application as needed. \n"
    "*****************************************"
)


class _Env(Action):
    """A flag whose default comes from ``PET_<DEST>`` when set (torchrun's ``env`` action)."""

    def __init__(self, dest: str, default=None, required: bool = False, **kwargs) -> None:
        env_value = os.environ.get(f"PET_{dest.upper()}")
        if env_value is not None:
            default, required = env_value, False
        super().__init__(dest=dest, default=default, required=required, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)


class _CheckEnv(Action):
    """A ``store_true`` flag that ``PET_<DEST>=1`` also turns on."""

    def __init__(self, dest: str, default: bool = False, **kwargs) -> None:
        env_value = os.environ.get(f"PET_{dest.upper()}")
        default = bool(int(env_value)) if env_value is not None else default
        super().__init__(dest=dest, const=True, default=default, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.const)


def _comma_separated(value: str) -> list[str]:
    """torchrun's list syntax: 'a,b' is two items, ',,' a literal comma."""
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


def _flag(name: str) -> list[str]:
    return [f"--{name}", f"--{name.replace('-', '_')}"] if "-" in name else [f"--{name}"]


def get_args_parser() -> ArgumentParser:
    p = ArgumentParser(prog="torchdist-run", description="torchdist's elastic launcher (torchrun's flags).")
    add = p.add_argument
    add(*_flag("nnodes"), action=_Env, type=str, default="1:1", help="Number of nodes, or MIN:MAX.")
    add(*_flag("nproc-per-node"), action=_Env, type=str, default="1",
        help="Workers per node: an integer, 'cpu' or 'auto'.")
    add(*_flag("rdzv-backend"), action=_Env, type=str, default="static", help="Rendezvous backend: c10d or static.")
    add(*_flag("rdzv-endpoint"), action=_Env, type=str, default="", help="Rendezvous endpoint host:port.")
    add(*_flag("rdzv-id"), action=_Env, type=str, default="none", help="Job id shared by all nodes.")
    add(*_flag("rdzv-conf"), action=_Env, type=str, default="",
        help="key=value,... (join_timeout, last_call_timeout, close_timeout, read_timeout, is_host, "
             "keep_alive_interval, keep_alive_max_attempt).")
    add("--standalone", action=_CheckEnv, help="Single node: c10d rendezvous on a free local port.")
    add(*_flag("max-restarts"), action=_Env, type=int, default=0, help="Worker group restarts before failing.")
    add(*_flag("monitor-interval"), action=_Env, type=float, default=0.1, help="Seconds between health checks.")
    add(*_flag("start-method"), action=_Env, type=str, default="spawn", choices=["spawn", "fork", "forkserver"],
        help="Accepted for torchrun compatibility; workers are always fresh processes.")
    add("--role", action=_Env, type=str, default="default", help="The workers' role name.")
    add("-m", "--module", action=_CheckEnv, help="Run the script as 'python -m module'.")
    add(*_flag("no-python"), action=_CheckEnv, help="Run the script as an executable, without python.")
    add(*_flag("run-path"), action=_CheckEnv, help="Run the script with runpy.run_path.")
    add(*_flag("log-dir"), action=_Env, type=str, default=None, help="Base directory of per-attempt, per-rank logs.")
    add("-r", "--redirects", action=_Env, type=str, default="0",
        help="Redirect streams to files: 0 none, 1 out, 2 err, 3 both, or per local rank '0:1,1:2'.")
    add("-t", "--tee", action=_Env, type=str, default="0",
        help="Like --redirects, and echo to the console with a rank prefix.")
    add(*_flag("local-ranks-filter"), action=_Env, type=str, default="",
        help="Show the console output of these local ranks only (e.g. 0,1).")
    add(*_flag("duplicate-stdout-filters"), action=_Env, type=_comma_separated, default=[],
        help="Echoed stdout lines containing one of these (e.g. 'apple,orange'; ',,' is a comma) also go to "
             "<log dir>/.../attempt_N/filtered_stdout.log.")
    add(*_flag("duplicate-stderr-filters"), action=_Env, type=_comma_separated, default=[],
        help="The same for stderr (filtered_stderr.log).")
    add(*_flag("virtual-local-rank"), action=_CheckEnv, help="Every worker sees LOCAL_RANK=0.")
    add(*_flag("event-log-handler"), action=_Env, type=str, default="null",
        help="Accepted for torchrun compatibility: torchdist-run records no elastic events ('null' only).")
    add(*_flag("logs-specs"), type=str, default=None,
        help="Accepted for torchrun compatibility: the default log layout ('default' or unset) only.")
    add(*_flag("numa-binding"), type=str, default=None, choices=["node", "socket", "exclusive", "core-complex"],
        help="torchrun binds GPU workers near their GPU; torchdist-run runs CPU workers and refuses it.")
    add(*_flag("node-rank"), type=int, action=_Env, default=0, help="This node's rank (static rendezvous).")
    add(*_flag("master-addr"), default="127.0.0.1", type=str, action=_Env, help="Node 0's address (static).")
    add(*_flag("master-port"), default=None, type=int, action=_Env, help="Node 0's port (static; 29500).")
    add(*_flag("local-addr"), default=None, type=str, action=_Env, help="This node's address.")
    add(*_flag("signals-to-handle"), action=_Env, type=str, default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="Signals forwarded to the workers.")
    add(*_flag("shutdown-timeout"), action=_Env, type=float, default=None,
        help="Seconds between SIGTERM and SIGKILL when stopping workers "
             "(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30).")
    add(*_flag("secret-file"), action=_Env, type=str, default=None,
        help="torchdist: read the job secret from this file (else TORCHDIST_SECRET; one node: random).")
    add("training_script", type=str, help="The script (or module, or executable) and its arguments.")
    add("training_script_args", nargs=REMAINDER)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return get_args_parser().parse_args(argv)


def _std(value: str, flag: str):
    try:
        return Std.from_str(value)
    except ValueError as exc:
        raise SystemExit(f"torchdist-run: {flag}: {exc}") from None


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, str, list[str]]:
    """The launch configuration, the command and its arguments, as torchrun derives them."""
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    nproc_per_node = parse_nproc_per_node(args.nproc_per_node)
    if (not args.standalone and args.rdzv_backend == "static" and not args.rdzv_endpoint
            and args.master_port is None and max_nodes == 1):
        # As torchrun 2.13: a one-node job that names no port takes a free one, so two
        # jobs side by side do not both claim 29500.
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        log.info("\n**************************************\nRendezvous info:\n--rdzv-backend=c10d "
                 "--rdzv-endpoint=localhost:0 --rdzv-id=%s\n**************************************\n", args.rdzv_id)
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        log.warning(_OMP_NOTICE)
        os.environ["OMP_NUM_THREADS"] = "1"
    rdzv_configs = parse_rdzv_conf(args.rdzv_conf)
    if args.rdzv_backend == "static":
        rdzv_configs["rank"] = args.node_rank
        endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or 29500}"
    else:  # torchrun's c10d default: a store on this host's port 29400
        endpoint = args.rdzv_endpoint or "localhost:29400"
    shutdown_timeout = args.shutdown_timeout
    if shutdown_timeout is None:
        shutdown_timeout = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    ranks_filter = None
    if args.local_ranks_filter:
        try:
            ranks_filter = frozenset(int(r) for r in args.local_ranks_filter.split(","))
        except ValueError:
            raise SystemExit(f"torchdist-run: --local-ranks-filter {args.local_ranks_filter!r}: "
                             "expected comma-separated local ranks") from None
    if args.event_log_handler != "null":
        raise ValueError(f"--event-log-handler {args.event_log_handler!r}: torchdist-run records no elastic events; "
                         "only 'null' is available")
    if args.logs_specs not in (None, "default"):
        raise ValueError(f"--logs-specs {args.logs_specs!r}: torchdist-run has only the default log layout")
    if args.numa_binding is not None:
        raise ValueError(f"--numa-binding {args.numa_binding}: it binds each worker near its GPU, and torchdist-run "
                         "runs CPU workers; leave it out")
    secret = None
    if args.secret_file:
        try:
            with open(args.secret_file) as fp:
                secret = fp.read().strip()
        except OSError as exc:
            raise SystemExit(f"torchdist-run: --secret-file: {exc}") from None
        if not secret:
            raise SystemExit(f"torchdist-run: --secret-file {args.secret_file} is empty")
    config = LaunchConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node, run_id=args.rdzv_id,
        role=args.role, rdzv_endpoint=endpoint, rdzv_backend=args.rdzv_backend, rdzv_configs=rdzv_configs,
        max_restarts=args.max_restarts, monitor_interval=args.monitor_interval, start_method=args.start_method,
        log_dir=args.log_dir, redirects=_std(args.redirects, "--redirects"), tee=_std(args.tee, "--tee"),
        local_ranks_filter=ranks_filter, local_addr=args.local_addr, shutdown_timeout=shutdown_timeout,
        signals_to_handle=parse_signals(args.signals_to_handle),
        log_line_prefix_template=os.getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"), secret=secret,
        duplicate_stdout_filters=tuple(f for f in args.duplicate_stdout_filters if f),
        duplicate_stderr_filters=tuple(f for f in args.duplicate_stderr_filters if f),
        virtual_local_rank=args.virtual_local_rank,
    )
    if args.run_path:
        cmd = os.getenv("PYTHON_EXEC", sys.executable)
        # as torchrun's: the script runs under @record, so its traceback reaches the summary
        runner = ("import runpy, sys; from torchdist.elastic.multiprocessing.errors import record; "
                  "sys.argv = sys.argv[1:]; record(lambda: runpy.run_path(sys.argv[0], run_name='__main__'))()")
        cmd_args = ["-u", "-c", runner, args.training_script, *args.training_script_args]
    elif args.no_python:
        if args.module:
            raise ValueError("Don't use both the '--no-python' flag and the '--module' flag at the same time.")
        cmd, cmd_args = args.training_script, list(args.training_script_args)
    else:
        cmd = os.getenv("PYTHON_EXEC", sys.executable)
        cmd_args = ["-u", *(["-m"] if args.module else []), args.training_script, *args.training_script_args]
    return config, cmd, cmd_args


def _setup_logging() -> None:
    """The launcher's own log lines: glog-like, as torchrun's; ``LOGLEVEL`` sets the level (WARNING)."""
    logger = logging.getLogger("torchdist")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s",
                                           datefmt="%m%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("LOGLEVEL", "WARNING").upper())
    logger.propagate = False


def run(args: argparse.Namespace) -> int:
    config, cmd, cmd_args = config_from_args(args)
    try:
        launch_agent(config, cmd, cmd_args, name=args.training_script)
    except ChildFailedError as exc:
        get_error_handler().dump_error_file(exc.get_first_failure()[1])  # for a launcher of this launcher
        sys.stderr.write(f"torchdist.elastic.multiprocessing.errors.ChildFailedError: \n{exc}\n")
        sys.stderr.flush()
        return 1
    except SignalException as exc:
        sys.stderr.write(f"torchdist-run: received {exc.sigval.name}; every worker was stopped\n")
        return 1  # torchrun's status: its SignalException ends the launcher
    except RendezvousError as exc:
        sys.stderr.write(f"torchdist-run: rendezvous failed: {type(exc).__name__}: {exc}\n")
        return 1
    return 0


@record
def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    try:
        return run(parse_args(argv))
    except ValueError as exc:  # a bad flag value: torchrun's status for it is 1 (its ValueError ends it)
        sys.stderr.write(f"torchdist-run: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
