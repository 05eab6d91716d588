"""Registry fixtures beside tests/conftest.py's redis-server and fresh registry: wait_until."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

WaitUntil = Callable[[Callable[[], bool], float], float]


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def wait_until() -> WaitUntil:
    """wait_until(predicate, timeout_s): poll until predicate() holds and return the seconds it
    took; fail the test on timeout."""
    return _wait_until
