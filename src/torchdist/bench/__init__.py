"""``torchdist-bench``: nccl-tests for CPU collectives, with a side-by-side gloo comparison.

Re-exports only; see ``cli`` (arguments), ``worker`` (what each rank times) and
``report`` (tables, JSON, plots).
"""

from .cli import main

__all__ = ["main"]
