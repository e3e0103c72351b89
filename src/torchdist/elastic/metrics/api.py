"""Metrics of an elastic job (torch.distributed.elastic.metrics.api): named values in groups, sent to handlers.

``put_metric(name, value, group)`` hands a :class:`MetricData` to the handler
configured for ``group`` (``configure(handler, group)``), else to the default one
(``configure(handler)``), a :class:`NullMetricHandler` at first. ``@prof`` publishes
``<name>.success`` / ``<name>.failure`` and ``<name>.duration.ms`` for each call.
"""

from __future__ import annotations

import abc
import time
import warnings
from collections import namedtuple
from functools import wraps
from typing import Any, Callable

__all__ = ["MetricsConfig", "MetricHandler", "ConsoleMetricHandler", "NullMetricHandler", "MetricStream",
           "configure", "getStream", "prof", "profile", "put_metric", "publish_metric", "get_elapsed_time_ms",
           "MetricData"]

MetricData = namedtuple("MetricData", ["timestamp", "group_name", "name", "value"])


class MetricsConfig:
    """Free-form parameters of a metrics backend (``initialize_metrics``)."""

    __slots__ = ["params"]

    def __init__(self, params: dict[str, str] | None = None) -> None:
        self.params = params if params is not None else {}


class MetricHandler(abc.ABC):
    """Where metric values go."""

    @abc.abstractmethod
    def emit(self, metric_data: MetricData) -> None: ...


class ConsoleMetricHandler(MetricHandler):
    """Prints ``[timestamp][group]: name=value`` (torch's format) to stdout."""

    def emit(self, metric_data: MetricData) -> None:
        print(f"[{metric_data.timestamp}][{metric_data.group_name}]: {metric_data.name}={metric_data.value}")


class NullMetricHandler(MetricHandler):
    """Drops every value (the default)."""

    def emit(self, metric_data: MetricData) -> None:
        pass


class MetricStream:
    """The values of one group, sent to one handler."""

    def __init__(self, group_name: str, handler: MetricHandler) -> None:
        self.group_name = group_name
        self.handler = handler

    def add_value(self, metric_name: str, metric_value: int) -> None:
        self.handler.emit(MetricData(time.time(), self.group_name, metric_name, metric_value))


_metrics_map: dict[str, MetricHandler] = {}
_default_metrics_handler: MetricHandler = NullMetricHandler()


def configure(handler: MetricHandler, group: str | None = None) -> None:
    """Send ``group``'s values (every group's without one of its own, when ``group`` is None) to ``handler``."""
    global _default_metrics_handler
    if group is None:
        _default_metrics_handler = handler
    else:
        _metrics_map[group] = handler


def getStream(group: str) -> MetricStream:  # noqa: N802 - torch's name
    return MetricStream(group, _metrics_map.get(group, _default_metrics_handler))


def put_metric(metric_name: str, metric_value: int, metric_group: str = "torchelastic") -> None:
    """Publish one value."""
    getStream(metric_group).add_value(metric_name, metric_value)


def publish_metric(metric_group: str, metric_name: str, metric_value: int) -> None:
    """Deprecated spelling of :func:`put_metric` (group first)."""
    warnings.warn("Deprecated, use `put_metric(metric_group)(metric_name, metric_value)` instead",
                  FutureWarning, stacklevel=2)
    getStream(metric_group).add_value(metric_name, metric_value)


def get_elapsed_time_ms(start_time_in_seconds: float) -> int:
    """Milliseconds since ``start_time_in_seconds`` (a ``time.time()``)."""
    return int((time.time() - start_time_in_seconds) * 1000)


def _get_metric_name(fn: Callable) -> str:
    """``Class.method``, or ``<leaf module>.function`` for a module-level function."""
    parts = fn.__qualname__.split(".")
    if len(parts) > 1:
        return fn.__qualname__
    return f"{fn.__module__.split('.')[-1]}.{parts[0]}" if fn.__module__ else parts[0]


def prof(fn: Callable | None = None, group: str = "torchelastic") -> Callable:
    """Decorator: each call publishes ``<name>.success`` or ``<name>.failure`` (1) and ``<name>.duration.ms``."""

    def wrap(f: Callable) -> Callable:
        @wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = _get_metric_name(f)
            start = time.time()
            try:
                result = f(*args, **kwargs)
                put_metric(f"{key}.success", 1, group)
            except Exception:
                put_metric(f"{key}.failure", 1, group)
                raise
            finally:
                put_metric(f"{key}.duration.ms", get_elapsed_time_ms(start), group)
            return result

        return wrapper

    return wrap(fn) if fn else wrap


def profile(group: str | None = None) -> Callable:
    """Deprecated decorator (use :func:`prof`): ``<function name>.success/.failure/.duration.ms`` in ``group``."""
    warnings.warn("Deprecated, use `@prof` instead", FutureWarning, stacklevel=2)

    def wrap(func: Callable) -> Callable:
        @wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                result = func(*args, **kwargs)
                getStream(group).add_value(f"{func.__name__}.success", 1)
            except Exception:
                getStream(group).add_value(f"{func.__name__}.failure", 1)
                raise
            finally:
                getStream(group).add_value(f"{func.__name__}.duration.ms", get_elapsed_time_ms(start))
            return result

        return wrapper

    return wrap
