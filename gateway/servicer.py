"""The public Generation service: validation and backpressure here, the rest in Relay (through
Migrator, which resumes a request elsewhere when a service fails).

`stream` is the one way into the stack: GenerateStream calls it, and so does the HTTP API
(gateway/http_api.py); it also records what clients see in the gateway's metrics. A resumable
gRPC request runs `stream` in the background and its clients follow it (gateway/resume.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from common.errors import InvalidRequestError, OverloadedError, ServiceError
from common.serving import tracing
from common.serving.grpc_util import status_of
from common.serving.metrics import GatewayMetrics, StreamTimer
from common.serving.proto_convert import FINISH_FROM_PB
from gateway.config import GatewayConfig
from gateway.frontend import Frontend, GenerateRequest
from gateway.instances import Instances
from gateway.migration import Migrator
from gateway.relay import Inflight
from gateway.resume import ResumableStreams
from protos.splitserve.v1 import (
    decode_pb2,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    types_pb2,
)

STATS_TIMEOUT_S = 2.0


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, config: GatewayConfig, frontend: Frontend, migrator: Migrator,
                 instances: Instances, eos_token_ids: tuple[int, ...], metrics: GatewayMetrics,
                 resumable: ResumableStreams):
        self.config = config
        self.frontend = frontend
        self.migrator = migrator
        self.resumable = resumable
        self.instances = instances
        self.eos_token_ids = eos_token_ids
        self.inflight: dict[str, Inflight] = {}
        self.metrics = metrics

    async def GenerateStream(self, request: GenerateRequest,
                             context: grpc.aio.ServicerContext,
                             ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        async with contextlib.aclosing(self._client_stream(request, context)) as pieces:
            async for msg in pieces:
                yield msg

    def _client_stream(self, request: GenerateRequest,
                       context: grpc.aio.ServicerContext,
                       ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """What this call streams: a new request, a new resumable one, or a resumed one."""
        if request.HasField("resume"):
            resume = request.resume
            return self.resumable.follow(
                request.request_id, resume.num_tokens_received,
                resume.num_messages_received if resume.HasField("num_messages_received")
                else None)
        parent = tracing.context_from(context.invocation_metadata())
        if not request.resumable:
            return self.stream(request, context.time_remaining(), parent)
        if not request.request_id:
            raise InvalidRequestError("a resumable request needs a request_id to reconnect with")
        self.resumable.open(request.request_id,
                            self.stream(request, context.time_remaining(), parent))
        return self.resumable.follow(request.request_id)

    async def stream(self, request: GenerateRequest, timeout_s: float | None,
                     parent: tracing.Context | None = None,
                     ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """One request through the stack; timeout_s None: --request-timeout-s. parent: the
        caller's trace context (None: the request's trace starts here)."""
        arrival = time.monotonic()
        timer = StreamTimer(arrival)
        span = tracing.start("gateway.request", parent, kind=tracing.SpanKind.SERVER)
        try:
            async with contextlib.aclosing(
                    self._stream(request, arrival, timeout_s, span)) as pieces:
                async for msg in pieces:
                    now = time.monotonic()
                    self.metrics.observe_tokens(timer, len(msg.token_ids), now)
                    if msg.finish_reason and msg.HasField("usage"):  # the last (n > 1)
                        self.metrics.observe_finished(timer, FINISH_FROM_PB[msg.finish_reason],
                                                      msg.usage.prompt_tokens, now)
                        tracing.finished(span, msg.usage, msg.finish_reason)
                    yield msg
        except asyncio.CancelledError:
            self.metrics.observe_failed(grpc.StatusCode.CANCELLED.name)
            tracing.failed(span, grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as exc:
            self.metrics.observe_failed(status_of(exc)[0].name)
            tracing.failed(span, f"{status_of(exc)[0].name}: {exc}")
            raise
        finally:
            span.end()

    async def _stream(self, request: GenerateRequest, arrival: float,
                      timeout_s: float | None, span: tracing.Span,
                      ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        if len(self.inflight) >= self.config.max_inflight:
            raise OverloadedError(f"the gateway is serving its limit of "
                                  f"{self.config.max_inflight} requests; retry later")
        req = self.frontend.prepare(request)
        if req.request_id in self.inflight:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {req.request_id!r} is already in flight")
        handle = Inflight(req.request_id, f"{req.request_id}-{uuid.uuid4().hex[:8]}",
                          span=span)
        span.set_attributes({"splitserve.request_id": req.request_id,
                             "splitserve.prompt_tokens": len(req.prompt_token_ids)})
        self.inflight[req.request_id] = handle
        deadline = arrival + (self.config.request_timeout_s if timeout_s is None else timeout_s)
        try:
            async with contextlib.aclosing(
                    self.migrator.run(req, handle, arrival, deadline)) as run:
                async for msg in run:
                    yield msg
        finally:
            del self.inflight[req.request_id]

    async def Generate(self, request: GenerateRequest,
                       context: grpc.aio.ServicerContext) -> generation_pb2.GenerateResponse:
        out = generation_pb2.GenerateResponse()
        choices: dict[int, generation_pb2.GeneratedChoice] = {}
        async for msg in self.GenerateStream(request, context):
            out.request_id = msg.request_id
            out.prompt_logprobs.extend(msg.prompt_logprobs)
            choice = choices.setdefault(msg.index, generation_pb2.GeneratedChoice(index=msg.index))
            choice.token_ids.extend(msg.token_ids)
            choice.logprobs.extend(msg.logprobs)
            choice.text += msg.text
            if msg.finish_reason:
                choice.finish_reason = msg.finish_reason
            if msg.HasField("usage"):
                out.usage.CopyFrom(msg.usage)
                out.timings.CopyFrom(msg.timings)
        first = choices.get(0, generation_pb2.GeneratedChoice())
        out.token_ids.extend(first.token_ids)
        out.logprobs.extend(first.logprobs)
        out.text, out.finish_reason = first.text, first.finish_reason
        if len(choices) > 1:
            out.choices.extend(choices[i] for i in sorted(choices))
        return out

    async def Tokenize(self, request: generation_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generation_pb2.TokenizeResponse:
        return self.frontend.tokenize(request)

    async def ModelInfo(self, request: generation_pb2.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> generation_pb2.ModelInfoResponse:
        prefills = await self.instances.get("prefill")
        decodes = await self.instances.get("decode")
        everyone = [*prefills, *decodes]
        out = generation_pb2.ModelInfoResponse(
            model=self.frontend.model_name, max_model_len=self.frontend.max_model_len,
            vocab_size=self.frontend.vocab_size,
            block_size=everyone[0].block_size if everyone else 0,
            eos_token_ids=self.eos_token_ids, num_prefill_instances=len(prefills),
            num_decode_instances=len(decodes), num_inflight=len(self.inflight))
        if request.include_instances:
            calls = [self.instances.prefill_stub(i.address).Stats(
                prefill_pb2.PrefillServiceStatsRequest(), timeout=STATS_TIMEOUT_S)
                for i in prefills]
            calls += [self.instances.decode_stub(i.address).Stats(
                decode_pb2.DecodeServiceStatsRequest(), timeout=STATS_TIMEOUT_S)
                for i in decodes]
            for reply in await asyncio.gather(*calls, return_exceptions=True):
                if not isinstance(reply, BaseException):
                    out.instances.append(reply.stats)
        return out

    async def Abort(self, request: types_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> types_pb2.AbortResponse:
        handle = self.inflight.get(request.request_id)
        if handle is not None:
            handle.abort()
        return types_pb2.AbortResponse(found=handle is not None)
