"""Tools for testing distributed code: run a function on N ranks and check the results.

Re-exports only; see :mod:`torchdist.testing.harness`.
"""

from .harness import RankOutcome, RanksFailed, RankStatus, free_port, run_ranks

__all__ = ["RankOutcome", "RankStatus", "RanksFailed", "free_port", "run_ranks"]
