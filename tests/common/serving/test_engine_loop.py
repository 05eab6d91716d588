"""EngineLoop drives the real engine (SmolLM2-135M-Instruct) from its thread."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.errors import EngineDroppedRequest, EngineLoopStopped, InvalidRequestError
from common.flags import build
from common.serving.engine_loop import AsyncOutputStream, EngineLoop

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
         "The three primary colors are", "To bake bread you need", "Water boils at"]


@pytest.fixture(scope="module")
def engine(model_cache_dir) -> LLMEngine:
    return LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir), num_kv_blocks=128,
                                  block_size=4))


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return [engine.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(engine, prompts) -> list[list[int]]:
    # On a worker thread like the loop's: torch steps run slower on the main thread here.
    with ThreadPoolExecutor(1) as pool:
        outputs = pool.submit(engine.generate, prompts, GREEDY).result()
    return [o.output_token_ids for o in outputs]


@pytest.fixture
def loop(engine):
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()
    assert engine.block_manager.num_used_blocks == 0


def drain(q: queue.SimpleQueue, timeout: float = 30.0) -> list:
    items = []
    while True:
        item = q.get(timeout=timeout)
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items


def test_thread_sinks_see_the_engines_tokens(loop, prompts, expected):
    sinks = [queue.SimpleQueue() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
        loop.submit(f"r{i}", prompt, GREEDY, sink.put).result(timeout=10)
    for sink, want in zip(sinks, expected, strict=True):
        outputs = drain(sink)
        assert [t for o in outputs for t in o.new_token_ids] == want
        assert outputs[-1].finish_reason == "length"
    assert loop.num_inflight == 0


def test_async_streams_from_one_event_loop(loop, prompts, expected):
    async def one(i: int) -> list[int]:
        stream = AsyncOutputStream()
        await asyncio.wrap_future(loop.submit(f"a{i}", prompts[i], GREEDY, stream))
        return [t async for o in stream for t in o.new_token_ids]

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    assert asyncio.run(main()) == expected


def test_refused_request_fails_its_future(loop):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        loop.submit("bad", [], GREEDY, lambda _: None).result(timeout=10)
    assert loop.num_inflight == 0


def test_abort_ends_the_stream_and_frees_blocks(loop, prompts):
    sink = queue.SimpleQueue()
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    loop.submit("long", prompts[3], long, sink.put).result(timeout=10)
    assert not isinstance(sink.get(timeout=10), BaseException)  # it runs
    assert loop.abort("long").result(timeout=10) is True
    items = drain(sink)
    assert isinstance(items[-1], EngineDroppedRequest)
    assert loop.call(lambda e: e.block_manager.num_used_blocks).result(timeout=10) == 0
    assert loop.abort("long").result(timeout=10) is False


def test_calls_run_on_the_loop_thread_and_idle_loop_sleeps(loop):
    name = loop.call(lambda e: threading.current_thread().name).result(timeout=10)
    assert name == "engine-loop"
    steps = loop.num_steps
    time.sleep(0.2)
    assert loop.num_steps == steps  # no stepping (and no spinning) without requests


def test_hold_kv_then_release(loop, prompts):
    sink = queue.SimpleQueue()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    loop.submit("held", prompts[2], params, sink.put, hold_kv=True).result(timeout=10)
    (out,) = drain(sink)
    assert out.held_block_ids and len(out.held_block_ids) == -(-len(prompts[2]) // 4)
    used = loop.call(lambda e: e.block_manager.num_used_blocks).result(timeout=10)
    assert used == len(out.held_block_ids)
    assert loop.call(lambda e: e.kv.release("held")).result(timeout=10) is True


def test_stop_aborts_what_is_in_flight(engine, prompts):
    loop = EngineLoop(engine).start()
    sink = queue.SimpleQueue()
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    loop.submit("s", prompts[1], long, sink.put).result(timeout=10)
    sink.get(timeout=10)
    loop.stop()
    assert isinstance(drain(sink)[-1], EngineDroppedRequest)
    assert engine.block_manager.num_used_blocks == 0
    with pytest.raises(EngineLoopStopped):
        loop.call(lambda e: None)
