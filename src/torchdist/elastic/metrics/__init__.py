"""Metrics of an elastic job (torch.distributed.elastic.metrics), re-exports only (see :mod:`.api`).

The agent publishes torch's metrics in group ``torchelastic``: ``workers.<role>.<state>``,
``workers.<role>.remaining_restarts``, ``workers.<role>.run_total``, ``...flakiness`` and
the ``@prof`` timings of its rendezvous and start/restart steps.
"""

from __future__ import annotations

from .api import (
    ConsoleMetricHandler,
    MetricData,
    MetricHandler,
    MetricsConfig,
    MetricStream,
    NullMetricHandler,
    configure,
    get_elapsed_time_ms,
    getStream,
    prof,
    profile,
    publish_metric,
    put_metric,
)

__all__ = ["ConsoleMetricHandler", "MetricData", "MetricHandler", "MetricStream", "MetricsConfig",
           "NullMetricHandler", "configure", "getStream", "get_elapsed_time_ms", "initialize_metrics", "prof",
           "profile", "publish_metric", "put_metric"]


def initialize_metrics(cfg: MetricsConfig | None = None) -> None:
    """A hook for a metrics backend's set-up; does nothing (as torch's open-source build)."""
