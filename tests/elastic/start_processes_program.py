"""``start_processes`` as a torch.distributed.elastic program, run on either library.

``python start_processes_program.py torch|torchdist LOG_DIR OUT_JSON`` starts an
executable and functions through torch's API and writes what it observed to
OUT_JSON (paths relative to LOG_DIR); teed lines go to this process's stdout.
"""

import json
import os
import sys

LIB, LOG_DIR, OUT = sys.argv[1:4]
if LIB == "torch":
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
else:
    from torchdist.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes


def square(x):
    print(f"square {x} on {os.environ['LOCAL_RANK']}", flush=True)
    return x * x


def boom(message):
    raise ValueError(message)


def _run(name, entrypoint, args, redirects=Std.NONE, tee=Std.NONE):
    envs = {rank: {"LOCAL_RANK": str(rank), "TORCHELASTIC_RUN_ID": name} for rank in args}
    specs = DefaultLogsSpecs(log_dir=os.path.join(LOG_DIR, name), redirects=redirects, tee=tee)
    context = start_processes(name, entrypoint, args, envs, specs, log_line_prefixes={r: f"[{name}{r}]:" for r in args})
    try:
        result = context.wait(timeout=60, period=0.1)
    finally:
        context.close()

    def rel(path):
        return os.path.relpath(path, LOG_DIR).split(os.sep, 2)[-1] if path else ""  # drop "<name>/<run>_xxx/"

    def read(path):
        return open(path).read() if path and os.path.isfile(path) else None

    return {
        "context": type(context).__name__,
        "failed": result.is_failed(),
        "return_values": {str(k): v for k, v in result.return_values.items()},
        "failures": {str(k): [f.exitcode, f.local_rank, f.message]
                     for k, f in result.failures.items()},
        "stdouts": {str(k): [rel(p), read(p)] for k, p in result.stdouts.items()},
        "stderrs": {str(k): [rel(p), read(p)] for k, p in result.stderrs.items()},
    }


def main():
    code = "import sys; print('hello', sys.argv[1]); print('oops', file=sys.stderr); sys.exit(int(sys.argv[2]))"
    observed = {
        "binary_ok": _run("bin", sys.executable, {0: ("-c", code, "a", 0), 1: ("-c", code, "b", 0)},
                          redirects={0: Std.OUT}, tee={1: Std.ALL}),
        "binary_fails": _run("binfail", sys.executable, {0: ("-c", code, "a", 3)}, redirects=Std.ERR),
        "function_ok": _run("fn", square, {0: (3,), 1: (4,)}, tee=Std.OUT),
        "function_fails": _run("fnfail", boom, {0: ("bad",)}, redirects=Std.ALL),
    }
    with open(OUT, "w") as f:
        json.dump(observed, f, indent=1)


if __name__ == "__main__":
    main()
