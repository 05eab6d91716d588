"""One request through the stack, relayed to the client as one stream:

    route -> Decode (stream; reserves blocks for the KV and waits)  ---------------+
          -> Prefill (stream) -> first token to the client at once                 |
                              -> DecodeService.Deliver, prefill to decode directly -> Decode stream:
                                                                 the remaining tokens to the client

Both calls go out at once, so the decode side's reservation overlaps the prefill, and nothing of
the gateway's lies between the prefill's last token and the decode's first step.

or, for prompts up to local_prefill_max_tokens (or when no prefill instance has the decode
instance's tensor parallel size), Decode alone with prefill_locally. A request that
ends any other way than with its last token (client cancel, Abort, deadline, error) is aborted on
both services it reached, so each frees its blocks (the prefill side also its held handoff).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
import redis

from common.engine.core.block_manager import hash_prefix_blocks
from common.errors import ClientAborted, DeadlineExceededError, ServiceError
from common.registry import InstanceInfo, Registry
from common.serving import tracing
from common.serving.express import ExpressClient
from common.serving.proto_convert import ms
from gateway.config import GatewayConfig
from gateway.frontend import PreparedRequest
from gateway.instances import Instances
from gateway.router import Router
from protos.splitserve.v1 import decode_pb2, generation_pb2, prefill_pb2, types_pb2

log = logging.getLogger("splitserve.gateway.relay")

ABORT_TIMEOUT_S = 2.0


@dataclass(slots=True)
class Inflight:
    """A request the gateway is serving: where it went and its open internal calls."""
    request_id: str                       # the client's id
    internal_id: str                      # the id the services know it by
    prefill: InstanceInfo | None = None
    decode: InstanceInfo | None = None
    # The instance whose stream is being read: a failure now is its failure (both calls are
    # open during the prefill stage, and only the one read fails the attempt).
    current: InstanceInfo | None = None
    calls: list[grpc.aio.Call] = field(default_factory=list)
    aborted: bool = False
    # The request's span (common/serving/tracing.py): the services' spans are its children.
    span: tracing.Span = tracing.NO_SPAN
    # n > 1 after a migration: one request per unfinished choice (gateway/migration.py),
    # aborted with this one.
    children: list[Inflight] = field(default_factory=list)

    def abort(self) -> None:
        self.aborted = True
        for call in self.calls:
            call.cancel()
        for child in self.children:
            child.abort()

    def check(self) -> None:
        if self.aborted:
            raise ClientAborted(f"request {self.request_id!r} was aborted by its client")


@dataclass(slots=True)
class _Progress:
    """What the client is told at the end: token counts and where the time went."""
    arrival: float
    usage: types_pb2.Usage
    timings: types_pb2.StageTimings
    completed: bool = False

    def final(self, request_id: str, reason: int, token_ids: Sequence[int] = (),
              text: str = "", logprobs: Sequence[types_pb2.TokenLogprobs] = (),
              ) -> generation_pb2.GenerateStreamResponse:
        self.completed = reason != types_pb2.FINISH_REASON_ABORT
        self.timings.total_ms = ms(time.monotonic() - self.arrival)
        return generation_pb2.GenerateStreamResponse(
            request_id=request_id, token_ids=token_ids, text=text, finish_reason=reason,
            usage=self.usage, timings=self.timings, logprobs=logprobs)


class _DecodeCall:
    """A call's messages, the first one from its express reply when that comes first (the call's
    copy of it is then dropped: common/serving/express.py); aclose() (also when never iterated)
    cancels the call, a no-op after its end, and forgets it. A Decode call's express reply is
    the decode engine's first message."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, handle: Inflight,
                 client: ExpressClient | None = None, express: asyncio.Future | None = None):
        self.call = call
        self.handle = handle
        self.client = client
        self.express = express
        self._pending: asyncio.Future | None = None  # the call's first message, still awaited

    async def __aiter__(self) -> AsyncIterator:
        messages = aiter(self.call)
        if self.express is None:
            async for msg in messages:
                yield msg
            return

        async def first_message():
            return await anext(messages, None)

        # Not cancelled when the caller stops early: that would end the call's message stream
        # (aclose() cancels the call itself, or reads it to its end).
        self._pending = first = asyncio.ensure_future(first_message())
        first.add_done_callback(_retrieve)
        await asyncio.wait((first, self.express), return_when=asyncio.FIRST_COMPLETED)
        by_express = self.express.done() and not self.express.cancelled()
        if by_express:
            yield self.express.result()
        msg = await first  # after an express reply, the call's copy of it: dropped
        self._pending = None
        if msg is None:
            return
        if not by_express:
            yield msg
        async for msg in messages:
            yield msg

    def _forget(self) -> None:
        if self.client is not None:
            self.client.forget_decode(self.handle.internal_id)

    async def aclose(self) -> None:
        self._forget()
        if self.call in self.handle.calls:
            self.handle.calls.remove(self.call)
        self.call.cancel()


# Prefill calls read to their end after their caller is done (_PrefillCall.aclose).
_DRAINING: set[asyncio.Task] = set()


def _retrieve(task: asyncio.Future) -> None:
    """A done callback: the outcome of a task nobody may await is retrieved (not logged)."""
    if not task.cancelled():
        task.exception()


class _PrefillCall(_DecodeCall):
    """A Prefill call's messages (the first one from the express reply when that comes first);
    counted in the router's load of `prefill` until aclose()."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, handle: Inflight, prefill: InstanceInfo,
                 router: Router, client: ExpressClient | None = None,
                 express: asyncio.Future[prefill_pb2.PrefillResponse] | None = None):
        super().__init__(call, handle, client, express)
        self.prefill = prefill
        self.router = router
        self.rid = handle.internal_id
        self.closed = False

    def _forget(self) -> None:
        if self.client is not None:
            self.client.forget(self.rid)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.router.release(self.prefill.instance_id)
        self._forget()
        if (self.express is not None and self.express.done() and not self.express.cancelled()
                and not self.call.done() and not self.handle.aborted):
            # The express reply came first and the caller is done (the first token ended the
            # request): the call still runs to its end, so that the prefill service adopts the
            # work and releases the prompt's blocks now, not when its express start expires.
            task = asyncio.get_running_loop().create_task(self._drain())
            _DRAINING.add(task)
            task.add_done_callback(_DRAINING.discard)
            return
        await super().aclose()

    async def _drain(self) -> None:
        try:
            if self._pending is not None:
                await self._pending
            async for _ in self.call:
                pass
        except grpc.aio.AioRpcError:
            pass
        finally:
            await super().aclose()


class Relay:
    def __init__(self, config: GatewayConfig, registry: Registry, instances: Instances,
                 router: Router, express: ExpressClient | None = None):
        self.config = config
        self.registry = registry
        self.instances = instances
        self.router = router
        self.express = express  # datagrams to prefill services of this host, ahead of calls
        self._background: set[asyncio.Task] = set()

    async def run(self, req: PreparedRequest, handle: Inflight, arrival: float,
                  deadline: float) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        st = _Progress(arrival, types_pb2.Usage(prompt_tokens=len(req.prompt_token_ids)),
                       types_pb2.StageTimings())
        decode: InstanceInfo | None = None
        route = tracing.start("gateway.route", handle.span)
        try:
            decode = await self._pick_decode(req.prompt_token_ids, req.params.max_tokens)
            self.router.acquire(decode.instance_id)  # counted from now, so a burst spreads out
            handle.decode = handle.current = decode
            st.timings.decode_instance = decode.instance_id
            local = len(req.known_token_ids) <= self.config.local_prefill_max_tokens
            source: dict = {"prefill_locally": True}
            route.set_attribute("splitserve.decode_instance", decode.instance_id)
            prefill = None if local else await self._pick_prefill(req.known_token_ids, decode)
            local = prefill is None
            if not local:
                handle.check()
                handle.prefill = handle.current = prefill
                source = {"handoff": decode_pb2.Handoff(include_first_text=bool(req.params.stop),
                                                        prefill_instance_id=prefill.instance_id)}
                route.set_attribute("splitserve.prefill_instance", prefill.instance_id)
            route.end()
            # The Prefill call goes out first (it is on the TTFT path), the Decode call right
            # after it: with a handoff it reserves blocks while the prefill queues and computes
            # (a doorbell rung before the reservation is left to the Deliver call).
            st.timings.gateway_ms = ms(time.monotonic() - st.arrival)
            first = None if local else self._prefill(req, handle, prefill, decode, deadline)
            try:
                if first is not None:
                    await asyncio.sleep(0)  # the call's request is written by a task of its own
                stream = self._decode(req, handle, decode, source, deadline)
            except BaseException:
                if first is not None:
                    await first.aclose()
                raise
            async with aclosing(stream):
                if first is not None:
                    async for msg in self._prefill_stage(req, handle, first, decode, st):
                        yield msg
                    if st.completed:
                        return
                    handle.check()
                    handle.current = decode
                async for msg in self._decode_stage(stream, local, st, req):
                    yield msg
        except (asyncio.CancelledError, ClientAborted):
            # Abort() cancelled our internal calls: end the stream with an abort message. The
            # client cancelling its own call cancels this task instead: let that through.
            current = asyncio.current_task()
            if not handle.aborted or (current is not None and current.cancelling()):
                raise
            yield st.final(req.request_id, types_pb2.FINISH_REASON_ABORT)
        finally:
            if route.is_recording():  # routing failed
                route.end()
            if decode is not None:
                self.router.release(decode.instance_id)
            if not st.completed:
                self._abort_everywhere(handle)

    async def _prefill_stage(self, req: PreparedRequest, handle: Inflight,
                             call: _PrefillCall, decode: InstanceInfo, st: _Progress,
                             ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """The first token for the client at once; returns when the prefill service has handed
        the KV to the decode service (or the first token ended the request)."""
        first = True
        prefill = call.prefill
        async with aclosing(call) as stream:
            async for resp in stream:
                if not first:  # second message: how the delivery went
                    st.timings.handoff_publish_ms = resp.deliver_ms
                    if not resp.delivered:
                        log.info("request %s: %s did not take the KV from %s; it recomputes",
                                 req.request_id, decode.instance_id, prefill.instance_id)
                    return
                first = False
                first_logprobs = [resp.first_logprobs] if resp.HasField("first_logprobs") else []
                t = st.timings
                t.prefill_queue_ms, t.prefill_compute_ms = resp.queue_ms, resp.compute_ms
                t.prefill_instance = resp.instance_id
                t.ttft_ms = ms(time.monotonic() - st.arrival)
                st.usage.num_cached_tokens, st.usage.completion_tokens = resp.num_cached_tokens, 1
                if resp.finish_reason:
                    final = st.final(req.request_id, resp.finish_reason, [resp.first_token_id],
                                     resp.first_text, first_logprobs)
                    final.prompt_logprobs.extend(resp.prompt_logprobs)
                    yield final
                    return
                # With stop strings the first token's text comes from the decode side, whose
                # matcher sees what follows it (the prefill side had to flush held-back text).
                # n > 1: this is choice 0's first token (the prefill service reports no finish
                # for it; the decode service, which forks the other choices, does).
                yield generation_pb2.GenerateStreamResponse(
                    request_id=req.request_id, token_ids=[resp.first_token_id],
                    text="" if req.params.stop else resp.first_text, logprobs=first_logprobs,
                    prompt_logprobs=resp.prompt_logprobs)
        raise ServiceError(grpc.StatusCode.INTERNAL,
                           f"prefill {prefill.instance_id} ended without delivering the KV")

    async def _decode_stage(self, stream: _DecodeCall, local: bool,
                            st: _Progress, req: PreparedRequest,
                            ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """The decode service's messages; with n > 1 each choice's last one carries its
        finish reason, and the stream ends with the last choice's (usage and timings)."""
        unfinished = req.params.n
        async for msg in stream:
            if not st.timings.ttft_ms and msg.token_ids:
                st.timings.ttft_ms = ms(time.monotonic() - st.arrival)
            st.usage.completion_tokens += len(msg.token_ids)
            if msg.handoff_ms:
                st.timings.handoff_ms = msg.handoff_ms
            if msg.handoff_critical_ms:
                st.timings.handoff_critical_ms = msg.handoff_critical_ms
            if local:
                st.usage.num_cached_tokens = msg.num_cached_tokens
            unfinished -= bool(msg.finish_reason)
            if msg.finish_reason and not unfinished:
                st.timings.decode_ms = msg.decode_ms
                final = st.final(req.request_id, msg.finish_reason, msg.token_ids, msg.text,
                                 msg.logprobs)
                final.index = msg.index
                final.prompt_logprobs.extend(msg.prompt_logprobs)
                yield final
                return
            yield generation_pb2.GenerateStreamResponse(
                request_id=req.request_id, token_ids=msg.token_ids, text=msg.text,
                logprobs=msg.logprobs, index=msg.index, finish_reason=msg.finish_reason,
                prompt_logprobs=msg.prompt_logprobs)

    async def _pick_decode(self, prompt: list[int], max_tokens: int) -> InstanceInfo:
        return self.router.pick_decode(await self.instances.get("decode"),
                                       len(prompt) + max_tokens)

    async def _pick_prefill(self, prompt: list[int], decode: InstanceInfo) -> InstanceInfo | None:
        """None: no prefill instance has decode's tensor parallel size (the decode instance
        then prefills the prompt itself; Router.pairable)."""
        registered = await self.instances.get("prefill")
        instances = self.router.pairable(registered, decode)
        if registered and not instances:
            return None
        cached: dict[str, int] = {}
        if len(instances) > 1 and self.config.router.prefix_token_weight > 0:
            hashes = hash_prefix_blocks(prompt, instances[0].block_size)
            if hashes:
                ids = [i.instance_id for i in instances]
                try:
                    cached = await asyncio.to_thread(self.registry.match_prefix, ids, hashes)
                except redis.RedisError as e:  # route on load alone while Redis is away
                    log.warning("prefix lookup failed, routing on load: %s", e)
        return self.router.pick_prefill(instances, cached)

    def _prefill(self, req: PreparedRequest, handle: Inflight, prefill: InstanceInfo,
                 decode: InstanceInfo, deadline: float) -> _PrefillCall:
        """The Prefill call, opened now (its request goes out at once), as its messages; on this
        host the express datagram goes out just before it (common/serving/express.py)."""
        request = prefill_pb2.PrefillRequest(
            request_id=handle.internal_id, prompt_token_ids=req.prompt_token_ids,
            params=req.params_pb, decode_instance_id=decode.instance_id,
            output_token_ids=req.output_token_ids, decode_address=decode.address)
        metadata = tracing.metadata_for(handle.span)
        timeout = _remaining(deadline)
        express = None
        if self.express is not None:
            express = self.express.send(prefill.address, prefill_pb2.ExpressPrefill(
                request=request, timeout_s=timeout,
                traceparent=next((v for k, v in metadata or () if k == "traceparent"), "")))
        call = self.instances.prefill_stub(prefill.address).Prefill(
            request, timeout=timeout, metadata=metadata)
        handle.calls.append(call)
        self.router.acquire(prefill.instance_id)
        return _PrefillCall(call, handle, prefill, self.router, self.express, express)

    def _decode(self, req: PreparedRequest, handle: Inflight, decode: InstanceInfo,
                source: dict, deadline: float) -> _DecodeCall:
        """The Decode call, opened now (its request goes out at once), as its messages; on this
        host its first message may come back as an express datagram as well."""
        express = (None if self.express is None
                   else self.express.expect_decode(handle.internal_id))
        call = self.instances.decode_stub(decode.address).Decode(
            decode_pb2.DecodeRequest(request_id=handle.internal_id,
                                     prompt_token_ids=req.prompt_token_ids,
                                     params=req.params_pb,
                                     output_token_ids=req.output_token_ids,
                                     express_reply_to=(self.express.decode_name
                                                       if express is not None else b""),
                                     **source),
            timeout=_remaining(deadline), metadata=tracing.metadata_for(handle.span))
        handle.calls.append(call)
        return _DecodeCall(call, handle, self.express if express is not None else None, express)

    def _abort_everywhere(self, handle: Inflight) -> None:
        """Tell every service the request reached to drop it (runs on after the client left)."""
        rid = handle.internal_id
        targets = []
        if handle.prefill is not None:
            targets.append((self.instances.prefill_stub(handle.prefill.address).Abort,
                            prefill_pb2.PrefillServiceAbortRequest(request_id=rid)))
        if handle.decode is not None:
            targets.append((self.instances.decode_stub(handle.decode.address).Abort,
                            decode_pb2.DecodeServiceAbortRequest(request_id=rid)))
        for abort, request in targets:
            task = asyncio.get_running_loop().create_task(_call_quietly(abort, request))
            self._background.add(task)
            task.add_done_callback(self._background.discard)


async def _call_quietly(method, request) -> None:
    try:
        await method(request, timeout=ABORT_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        log.warning("abort of %s failed: %s", request.request_id, e.code().name)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError("the request's deadline passed")
    return left
