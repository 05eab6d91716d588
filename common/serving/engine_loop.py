"""Drives one LLMEngine from one background thread; other threads and asyncio tasks talk to it.

The engine is not thread-safe, so everything that touches it runs on the loop's thread:
`submit`, `abort` and `call` queue a command and return a concurrent Future; the thread runs
queued commands between steps, then steps while any request is unfinished, and sleeps on a
condition when there is nothing to do (no polling).

Each request has a sink, called on the loop's thread with every RequestOutput of the request
(of each of its choices when n > 1), then never again once one is `last`. A request that ends without a final output (aborted
through this loop, the loop stopping, an engine error, or a grammar its parser refused: the
output's `error`) gets one exception instead:
EngineDroppedRequest or the error. `AsyncOutputStream` is a sink that hands items to an asyncio
loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from common.engine.core.sampling_params import SamplingParams
from common.errors import EngineDroppedRequest, EngineLoopStopped, RankFailure

if TYPE_CHECKING:
    from common.engine.engine import LLMEngine, Prefilled, RequestOutput

log = logging.getLogger("splitserve.engine_loop")

T = TypeVar("T")
Sink = Callable[["RequestOutput | BaseException"], None]


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "engine-loop"):
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._sinks: dict[str, Sink] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_steps = 0
        # Called on the loop's thread with a RankFailure: a tensor-parallel rank is gone and the
        # engine cannot step again (the service shuts down: common/serving/instance.py).
        self.on_fatal: Callable[[BaseException], None] | None = None
        engine.wakeup = self._wake  # a structured output's grammar compiled off the thread

    def _wake(self) -> None:
        """Any thread: step again even if the last step was idle (a no-op command)."""
        with self._cond:
            self._commands.append(lambda: None)
            self._cond.notify()

    # ---- control (any thread) -----------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request (their sinks get EngineDroppedRequest) and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_inflight(self) -> int:
        """Requests with a sink (submitted, not yet finished); read without the engine thread."""
        return len(self._sinks)

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run fn(engine) on the loop's thread between steps."""
        future: Future[T] = Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # handed to the caller through the future
                    future.set_exception(exc)

        with self._cond:
            if self._stopping:
                raise EngineLoopStopped("the engine loop is stopped")
            self._commands.append(command)
            self._cond.notify()
        return future

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sink: Sink, prefilled: Prefilled | None = None,
               output_token_ids: list[int] | None = None, hold_kv: bool = False) -> Future[None]:
        """Add a request; the future fails with the engine's InvalidRequestError if it refuses.

        With `prefilled`, its blocks pass to the engine: if the engine refuses the request, they
        are freed here (the caller must not free them). output_token_ids, hold_kv: see
        LLMEngine.add_request."""

        def add(engine: LLMEngine) -> None:
            try:
                engine.add_request(request_id, prompt_token_ids, params, prefilled,
                                   output_token_ids=output_token_ids or (), hold_kv=hold_kv)
            except BaseException:
                if prefilled is not None and prefilled.block_ids is not None:
                    engine.kv.free(prefilled.block_ids)
                raise
            self._sinks[request_id] = sink

        return self.call(add)

    def abort(self, request_id: str) -> Future[bool]:
        """Abort a request (or release its handoff hold); its sink, if any, gets
        EngineDroppedRequest."""

        def abort(engine: LLMEngine) -> bool:
            found = engine.abort(request_id)
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink(EngineDroppedRequest(f"request {request_id!r} was aborted"))
            return found or sink is not None

        return self.call(abort)

    # ---- the loop's thread --------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        idle = False  # the last step made no progress: wait for a command before stepping again
        while True:
            with self._cond:
                while not self._commands and not self._stopping and (
                        idle or not engine.has_unfinished()):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                command()
            if stopping:
                self._abort_all(lambda rid: EngineDroppedRequest(
                    f"request {rid!r} was dropped: the engine loop stopped"))
                return
            if commands:
                idle = False
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception as exc:
                    log.exception("engine step failed; aborting every request")
                    self._abort_all(lambda _rid, exc=exc: exc)
                    if isinstance(exc, RankFailure) and self.on_fatal is not None:
                        self.on_fatal(exc)
                    continue
                self.num_steps += 1
                self._dispatch(outputs)
                # Nothing ran and nothing came out: the waiting requests need blocks that only a
                # command (abort, kv.release, kv.free) can free.
                idle = not outputs and engine.num_running == 0

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.last:  # n > 1: a request's choices finish one by one
                del self._sinks[out.request_id]
            sink(out if out.error is None else out.error)

    def _abort_all(self, make_exc: Callable[[str], BaseException]) -> None:
        for request_id in list(self.engine.seqs):
            self.engine.abort(request_id)
        self.engine.kv.release_all()
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink(make_exc(request_id))


class AsyncOutputStream:
    """A sink that carries one request's outputs to an asyncio loop; iterate with `async for`.

    Create it on the loop that will read it. Iteration ends after the finished output and raises
    the exception a request ends with (EngineDroppedRequest, an engine error).
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def __call__(self, item: RequestOutput | BaseException) -> None:
        if not self._loop.is_closed():  # a service shutting down may have closed its loop
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.last:
                return
