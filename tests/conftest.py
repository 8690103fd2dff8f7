"""The test session's defaults against load (tests/timeouts.py): torch's threads per test process, set before
torch loads, and each test's timeout multiplied by the machine's load when the test starts; the slow tests first."""

from __future__ import annotations

import os
import sys

import pytest

from tests import timeouts

os.environ["OMP_NUM_THREADS"] = str(timeouts.threads())  # before any test module imports torch
if "torch" in sys.modules:  # a plugin loaded it first
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _base_timeout(item: pytest.Item) -> tuple[float | None, dict]:
    """The test's limit before scaling (its mark, else --timeout, else the ini's) and its mark's other settings."""
    mark = item.get_closest_marker("timeout")
    if mark is not None and (mark.args or "timeout" in mark.kwargs):
        base = mark.args[0] if mark.args else mark.kwargs["timeout"]
    else:
        try:
            base = item.config.getoption("timeout", None) or item.config.getini("timeout")
        except ValueError:  # pytest-timeout is not installed: no limits
            return None, {}
    kwargs = {k: v for k, v in mark.kwargs.items() if k != "timeout"} if mark is not None else {}
    return (float(base) if base else None), kwargs


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Before pytest-timeout reads the test's limit: the limit times the load factor, as the test's own mark."""
    base, kwargs = _base_timeout(item)
    if base:
        item.add_marker(pytest.mark.timeout(timeouts.scaled(base, timeouts.scale()), **kwargs), append=False)
    yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked slow first, each group in its collected order: under pytest-xdist the long multi-process
    tests start early and the short ones fill the workers around them, instead of a long test running alone at the
    end while the other worker has nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
