"""Registry fixtures: a real redis-server (EmbeddedRedis, a free port, never 6379) per module and a
fresh namespace per test."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from common.registry import BlockRegistry, EmbeddedRedis


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def registry(redis_server: EmbeddedRedis) -> Iterator[BlockRegistry]:
    reg = BlockRegistry(redis_server.url, namespace=f"test-{uuid.uuid4().hex[:8]}",
                        timeout_s=1.0, retries=1, done_ttl_s=5.0)
    yield reg
    reg.close()


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
