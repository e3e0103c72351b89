"""Shared pytest configuration for torchdist's tests.

Every test is bounded in time: pyproject.toml sets ``timeout = 120`` for
pytest-timeout, and a hang is a failure, not a stuck CI. Where pytest-timeout
is not installed, the fallback below enforces the same limit (or a
``@pytest.mark.timeout(seconds)`` marker) the way pytest-timeout's "thread"
method does: it prints every thread's stack and exits the test process, which
takes the ranks of ``torchdist.testing.run_ranks`` with it.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import sys
import threading
from typing import Iterator

import pytest

_HAVE_PYTEST_TIMEOUT = importlib.util.find_spec("pytest_timeout") is not None


def pytest_addoption(parser: pytest.Parser) -> None:
    if not _HAVE_PYTEST_TIMEOUT:
        # Declare pytest-timeout's ini keys so that pyproject.toml's stay valid.
        parser.addini("timeout", "per-test timeout in seconds (conftest fallback)", default="120")
        parser.addini("timeout_method", "ignored by the conftest fallback", default="thread")


def pytest_configure(config: pytest.Config) -> None:
    if not _HAVE_PYTEST_TIMEOUT:
        config.addinivalue_line("markers", "timeout(seconds): per-test timeout (conftest fallback)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if _HAVE_PYTEST_TIMEOUT:
        yield
        return
    marker = item.get_closest_marker("timeout")
    seconds = float(marker.args[0] if marker and marker.args else item.config.getini("timeout"))
    timer = threading.Timer(seconds, _time_out, args=(item, seconds))
    timer.daemon = True
    if seconds > 0:
        timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _time_out(item: pytest.Item, seconds: float) -> None:
    # Stop capturing first, or the stacks would go to the capture file.
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    sys.stderr.write(f"\n+++ Timeout: {item.nodeid} ran for more than {seconds:g} s +++\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(1)
