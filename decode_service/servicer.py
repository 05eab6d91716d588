"""The Decode gRPC service: a thin adapter from DecodeRequest to the engine's output stream.

A request arrives with a handoff (a prefill service computes its prompt KV and delivers it with
Deliver; handoff.py reserves blocks for it at once) or asks for a local prefill. A delivery that
cannot be used is recomputed here: the first token stays an output, so the stream still continues
after it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator

import grpc

from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import Prefilled
from common.errors import InvalidRequestError
from common.registry import HandoffDescriptor
from common.serving import tracing
from common.serving.engine_loop import AsyncOutputStream
from common.serving.express import ExpressReplier
from common.serving.instance import ServiceInstance
from common.serving.metrics import DecodeMetrics, StreamTimer
from common.serving.proto_convert import (
    FINISH_TO_PB,
    logprobs_to_pb,
    ms,
    params_from_pb,
    prompt_logprobs_to_pb,
)
from decode_service.handoff import HandoffInbox, Taken
from protos.splitserve.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger("splitserve.decode")


class _First:
    """The handoff's figures that the stream's first message carries (zeros for a local
    prefill), filled before the request reaches the engine, so that the engine thread's express
    copy of that message says what the stream's does."""

    def __init__(self, joined: float):
        self.handoff_ms = self.reserve_ms = self.critical_ms = 0.0
        self.joined = joined  # decode_ms of the express copy counts from here
        self.taken: Taken | None = None

    def fill(self, taken: Taken) -> None:
        self.taken = taken
        self.handoff_ms, self.reserve_ms = taken.handoff_ms, taken.reserve_ms
        # The critical path ends when the request, its KV in place and verified, is in the
        # engine's command queue (it joins the next step): the inbox submitted it the moment
        # the KV was verified (admitted), or the Decode call does now.
        if taken.first_token_unix_s:
            self.critical_ms = 1e3 * ((taken.admitted_unix_s or time.time())
                                      - taken.first_token_unix_s)
        self.joined = time.monotonic()


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, instance: ServiceInstance, inbox: HandoffInbox, metrics: DecodeMetrics,
                 lane: ExpressReplier | None = None):
        """lane: sends a stream's first message to the gateway's express reply socket when the
        request names one (None: never; off with --no-express and under TLS)."""
        self.instance = instance
        self.inbox = inbox
        self.metrics = metrics
        self.lane = lane
        # With debug logs: the engine's last launches (time.time() at entry, kind, seconds,
        # seconds building its input), for the handoff's breakdown of what ran between its
        # admission and token 2.
        self._launches: collections.deque[tuple[float, str, float, float]] = collections.deque(
            maxlen=64)
        if log.isEnabledFor(logging.DEBUG):
            offset = time.time() - time.perf_counter()
            instance.loop.engine.runner.step_listeners.append(
                lambda t: self._launches.append((offset + t.start, t.kind, t.seconds,
                                                 t.built - t.start)))

    async def Decode(self, request: decode_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.DecodeResponse]:
        rid = request.request_id
        if not rid:
            raise InvalidRequestError("request_id must not be empty")
        params = params_from_pb(request.params)
        prompt = list(request.prompt_token_ids)
        loop = self.instance.loop
        stream = AsyncOutputStream()
        start = time.monotonic()
        timer = StreamTimer(start)
        span = tracing.start("decode", tracing.context_from(context.invocation_metadata()),
                             kind=tracing.SpanKind.SERVER,
                             attributes={"splitserve.request_id": rid,
                                         "splitserve.source": request.WhichOneof("source")})
        self.instance.num_inflight += 1
        finished = False
        joined = None

        def end_span() -> None:
            if joined is not None:
                tracing.record("decode.generate", span, joined, time.monotonic())
            span.end()

        try:
            outputs = list(request.output_token_ids)
            first = _First(start)  # what the stream's first message says of the handoff
            sink = (self._express(rid, request, first, stream)
                    if self.lane is not None and request.express_reply_to else stream)
            taken = await self._take_over(request, prompt, params, sink, outputs, first)
            prefilled = (None if taken is None
                         else Prefilled(taken.block_ids, taken.first_token_id))
            if prefilled is not None:
                reserved = start + taken.reserve_ms / 1e3
                tracing.record("decode.reserve", span, start, reserved)
                tracing.record("decode.wait_kv", span, reserved, time.monotonic(),
                               {"splitserve.recomputed": prefilled.block_ids is None})
            await asyncio.wrap_future(
                taken.admitted if taken is not None and taken.admitted is not None
                else loop.submit(rid, prompt, params, sink, prefilled, outputs))
            # n > 1: each choice's messages carry its index; a choice's last message its
            # finish_reason; the stream ends after every choice's (out.last).
            joined = time.monotonic()
            started: set[int] = set()  # n > 1: the choices that sent a message
            async for out in stream:
                if not started and first.critical_ms and log.isEnabledFor(logging.DEBUG):
                    log.debug("handoff %s: critical path %.2f ms (first token -> queued here)%s;"
                              " launches since its admission: %s", rid, first.critical_ms,
                              _breakdown(first.taken), self._launches_since(first.taken))
                self.metrics.observe_tokens(timer, len(out.new_token_ids), time.monotonic())
                if out.finished:
                    self.metrics.observe_finished(timer, out.metrics, time.monotonic())
                message = self._response(out, request, first if not started else None,
                                         out.index not in started, joined)
                started.add(out.index)
                finished = out.last
                if finished:  # the span ends before the last message: a caller that cancels
                    end_span()  # once it has it may stop this generator at the yield for good
                yield message
        except BaseException as e:
            if not finished:  # cancelled after its last message: the request completed
                tracing.failed(span, repr(e))
            raise
        finally:
            if span.is_recording():
                end_span()
            self.instance.num_inflight -= 1
            if not finished:
                loop.abort(rid)

    def _response(self, out, request: decode_pb2.DecodeRequest, first: _First | None,
                  first_of_choice: bool, joined: float) -> decode_pb2.DecodeResponse:
        """The stream's message for one engine output (any thread). first: the handoff's
        figures, on the stream's first message only. first_of_choice: the output is its
        choice's first, whose text is the whole text so far when the gateway asked for it (the
        first token's text as this engine's stop-string matcher saw it)."""
        return decode_pb2.DecodeResponse(
            token_ids=out.new_token_ids,
            text=(out.text if first_of_choice and request.handoff.include_first_text
                  else out.new_text),
            finish_reason=FINISH_TO_PB[out.finish_reason if out.finished else None],
            num_cached_tokens=out.num_cached_tokens,
            handoff_ms=first.handoff_ms if first else 0.0,
            reserve_ms=first.reserve_ms if first else 0.0,
            handoff_critical_ms=first.critical_ms if first else 0.0,
            decode_ms=ms(time.monotonic() - joined), instance_id=self.instance.instance_id,
            logprobs=[logprobs_to_pb(lp) for lp in out.logprobs or ()],
            index=out.index, prompt_logprobs=prompt_logprobs_to_pb(out.prompt_logprobs))

    def _express(self, rid: str, request: decode_pb2.DecodeRequest, first: _First,
                 stream: AsyncOutputStream):
        """The engine's sink for a request whose gateway listens on this host: the stream's
        first message also goes to the gateway's express reply socket from the engine thread,
        the moment it is sampled (common/serving/express.py), then everything on to stream."""
        pending = True

        def sink(out) -> None:
            nonlocal pending
            if pending and not isinstance(out, BaseException):
                pending = False
                if first.taken is not None:
                    first.taken.marks["token 2 at the decode's sink"] = time.time()
                try:
                    if self.lane.reply_decode(request.express_reply_to, rid, self._response(
                            out, request, first, True, first.joined)):
                        self.metrics.express_replies.inc()
                except Exception:  # never into the engine loop: the stream carries it anyway
                    log.exception("request %s: the express reply failed", rid)
            stream(out)

        return sink

    async def _take_over(self, request: decode_pb2.DecodeRequest, prompt: list[int],
                         params: SamplingParams, sink, outputs: list[int],
                         first: _First) -> Taken | None:
        """Blocks reserved now, filled when the prefill service delivers: what the delivery
        brought, the request already submitted to the engine if the KV was verified
        (Taken.admitted); None for a local prefill. first: filled with the handoff's figures
        before the request reaches the engine."""
        if request.WhichOneof("source") != "handoff":
            return None
        engine = self.instance.loop.engine
        # Refused before reserving, so the delivery is not waited for in vain (the settings it
        # reads do not change after start-up).
        engine.validate(prompt, params_from_pb(request.params))
        block_size = engine.config.cache.block_size
        num_blocks = -(-(len(prompt) + len(request.output_token_ids)) // block_size)
        rid = request.request_id
        loop = self.instance.loop
        # A failed delivery leaves block_ids None and is not admitted: the prompt is recomputed
        # here, and the first token stays an output (stop strings, penalties and seeds see what
        # they would have).
        def admit(taken: Taken):
            first.fill(taken)
            return loop.submit(rid, prompt, params, sink,
                               Prefilled(taken.block_ids, taken.first_token_id), outputs)

        taken = await self.inbox.take(rid, num_blocks, request.handoff.prefill_instance_id,
                                      admit=admit)
        if taken.admitted is None:  # recomputed here: submitted by the caller
            first.fill(taken)
        return taken

    async def Deliver(self, request: decode_pb2.DeliverRequest,
                      context: grpc.aio.ServicerContext) -> decode_pb2.DeliverResponse:
        try:
            desc = HandoffDescriptor.from_json(request.descriptor_json)
        except (ValueError, TypeError, KeyError) as e:
            raise InvalidRequestError(f"descriptor_json: {e}") from e
        span = tracing.start("handoff.pull", tracing.context_from(context.invocation_metadata()),
                             kind=tracing.SpanKind.SERVER,
                             attributes={"splitserve.request_id": request.request_id})
        try:
            accepted, reason = await self.inbox.deliver(request.request_id, desc,
                                                        request.first_token_id,
                                                        context.time_remaining(), span,
                                                        request.first_token_unix_s)
        except BaseException as e:
            tracing.failed(span, repr(e))
            raise
        else:
            if not accepted:
                tracing.failed(span, reason)
        finally:
            span.end()
        return decode_pb2.DeliverResponse(accepted=accepted, reason=reason)

    async def Abort(self, request: decode_pb2.DecodeServiceAbortRequest,
                    context: grpc.aio.ServicerContext) -> decode_pb2.DecodeServiceAbortResponse:
        found = await asyncio.wrap_future(self.instance.loop.abort(request.request_id))
        return decode_pb2.DecodeServiceAbortResponse(found=found)

    async def Stats(self, request: decode_pb2.DecodeServiceStatsRequest,
                    context: grpc.aio.ServicerContext) -> decode_pb2.DecodeServiceStatsResponse:
        return decode_pb2.DecodeServiceStatsResponse(stats=await self.instance.stats(
            num_pending_handoffs=len(self.inbox.pending)))


    def _launches_since(self, taken: Taken | None) -> str:
        """The engine's launches (debug logs) from the admission on: kind @ ms after the
        first token (launch ms, of which building its input)."""
        if taken is None or not taken.admitted_unix_s:
            return ""
        t0 = taken.first_token_unix_s
        return ", ".join(f"{kind} @{1e3 * (start - t0):+.2f} ({1e3 * seconds:.2f}, "
                         f"input {1e3 * building:.2f})"
                         for start, kind, seconds, building in list(self._launches)
                         if start >= taken.admitted_unix_s - 0.005)


def _breakdown(taken: Taken | None) -> str:
    """The moments of a handoff's way here (Taken.marks), in ms after the first token."""
    if taken is None or not taken.marks:
        return ""
    return "; " + ", ".join(f"{name} {1e3 * (t - taken.first_token_unix_s):+.2f}"
                            for name, t in sorted(taken.marks.items(), key=lambda m: m[1]) if t)
