"""A Python function as an elastic worker: ``python -m torchdist.elastic.function_worker CALL RESULTS``.

torch's ``elastic_launch`` takes a function as the entrypoint and returns what every
rank's call returned. The agent starts every worker as a fresh process, so the
function travels as ``multiprocessing``'s spawn sends one: ``CALL`` holds the
parent's preparation data (``sys.path``, the main module to import again as
``__mp_main__``, so functions defined in a script resolve), then the pickled
function and its arguments. The worker runs it under ``record`` (its traceback
reaches the failure summary) and writes the return value, pickled, to
``RESULTS/<RANK>.pkl`` (``RESULTS/<local rank>.pkl`` for ``start_processes``).
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import pickle
import sys

from .multiprocessing.errors import record


def main(call_file: str, results: str, key: str | None = None) -> None:
    """Run the call; its value goes to ``RESULTS/<key>.pkl`` (``key``: the local rank, default ``$RANK``)."""
    with open(call_file, "rb") as f:
        multiprocessing.spawn.prepare(pickle.load(f))  # before the function: it may live in __main__
        function, args = pickle.load(f)
    value = record(function)(*args)
    path = os.path.join(results, f"{key if key is not None else os.environ['RANK']}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(value, f)
    os.replace(path + ".part", path)  # whole or absent: a rank killed while writing leaves no half


if __name__ == "__main__":
    main(*sys.argv[1:4])
