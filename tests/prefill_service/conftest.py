"""Fixtures of the prefill service's own parts (the redis-server and a fresh registry per test come
from tests/conftest.py): a small dummy engine on its loop thread per test (a fresh prefix cache
each time; building one costs ~0.15 s after the first)."""

from __future__ import annotations

import asyncio
import inspect
import queue
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine, RequestOutput
from common.flags import build
from common.serving.engine_loop import EngineLoop

MODEL = "dummy:tiny-llama"  # 512-token vocabulary
BLOCK_SIZE = 16
NUM_BLOCKS = 12

T = TypeVar("T")


@pytest.fixture
def engine() -> LLMEngine:
    return LLMEngine(build(EngineConfig, model=MODEL, device="cpu", block_size=BLOCK_SIZE,
                           num_kv_blocks=NUM_BLOCKS))


@pytest.fixture
def loop(engine: LLMEngine) -> Iterator[EngineLoop]:
    """The engine on its thread. At teardown, before the loop stops (stopping releases every
    hold, which would hide a leak): no block referenced, nothing held, the pool consistent."""
    loop = EngineLoop(engine).start()
    yield loop

    def accounts(e: LLMEngine) -> tuple[int, dict]:
        e.block_manager.check_invariants()
        return e.block_manager.num_free_blocks, dict(e.kv.held)

    try:
        assert loop.call(accounts).result(timeout=10) == (NUM_BLOCKS, {})
    finally:
        loop.stop()


def prompt(first: int, n: int) -> list[int]:
    """n distinct token ids from `first` on (below the dummy model's vocabulary of 512)."""
    return [(first + i) % 511 + 1 for i in range(n)]


@pytest.fixture
def prefill(loop: EngineLoop) -> Callable[..., RequestOutput]:
    """prefill(request_id, token_ids, hold=True): run a prompt as the Prefill servicer does (one
    token, greedy, its blocks held) and return its final output."""

    def run(request_id: str, token_ids: list[int], hold: bool = True) -> RequestOutput:
        sink: queue.SimpleQueue = queue.SimpleQueue()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        loop.submit(request_id, token_ids, params, sink.put, hold_kv=hold).result(timeout=10)
        while True:
            out = sink.get(timeout=30)
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                return out

    return run


async def on_engine(loop: EngineLoop, fn: Callable[[LLMEngine], T]) -> T:
    """fn(engine) on the engine's thread, awaited without blocking the event loop."""
    return await asyncio.wrap_future(loop.call(fn))


async def until(predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 5.0) -> float:
    """Poll a predicate (plain or async) until it holds; the seconds it took. Fails the test on
    timeout."""
    start = time.monotonic()
    while not await _value(predicate()):
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def _value(result: bool | Awaitable[bool]) -> bool:
    return await result if inspect.isawaitable(result) else result
