"""The Prefill gRPC service: a thin adapter from PrefillRequest to the engine and back.

A prompt runs with the client's sampling settings but max_tokens=1, its blocks held when it ends
(hold_kv). Its first
token goes out at once; unless it ends the request, its blocks are checksummed and delivered to
the decode service named in the request, and released when that call ends (delivery.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from common.engine.core.sampling_params import SamplingParams
from common.errors import InvalidRequestError
from common.kv_transport.blocks import handoff_bytes
from common.kv_transport.source import KVSource
from common.registry import HandoffDescriptor
from common.serving import tracing
from common.serving.engine_loop import AsyncOutputStream
from common.serving.express import ADOPT_WITHIN_S, ExpressListener
from common.serving.instance import ServiceInstance
from common.serving.metrics import PrefillMetrics
from common.serving.proto_convert import (
    FINISH_TO_PB,
    logprobs_to_pb,
    ms,
    params_from_pb,
    prompt_logprobs_to_pb,
)
from prefill_service.delivery import Deliveries
from prefill_service.prefix_sync import PrefixSync
from protos.splitserve.v1 import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("splitserve.prefill")


# Request ids remembered as started, to drop an express datagram that comes after its call.
STARTED_REMEMBERED = 4096


@dataclasses.dataclass(slots=True)
class _Run:
    """A prompt submitted to the engine, by its Prefill call or by an express datagram."""
    request: prefill_pb2.PrefillRequest
    params: SamplingParams
    carried: list[int]
    stream: AsyncOutputStream
    rung: dict[str, tuple[HandoffDescriptor, bool]]
    span: tracing.Span
    submitted: asyncio.Future[None]
    expiry: asyncio.TimerHandle | None = None  # an express start: aborted if no call adopts it
    expiry_s: float = 0.0


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, instance: ServiceInstance, source: KVSource, deliveries: Deliveries,
                 prefixes: PrefixSync, metrics: PrefillMetrics, early_handoff: bool = True):
        """early_handoff: --early-handoff (the decode's doorbell rung with an IPC event when a
        prompt's last step is launched, on a GPU; see _start)."""
        self.instance = instance
        self.source = source
        self.deliveries = deliveries
        self.prefixes = prefixes
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()
        self.handing_off: set[str] = set()  # checksumming or delivering: they release the blocks
        # The express lane (common/serving/express.py): prompts started by a datagram, until
        # their Prefill call adopts them; the ids started lately (a datagram after its call is
        # dropped); the listener, once the server opened it.
        self.express: dict[str, _Run] = {}
        self._started: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.lane: ExpressListener | None = None
        self.early_handoff = early_handoff

    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext,
                      ) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        rid = request.request_id
        run = self.express.pop(rid, None)  # started by the gateway's datagram: adopted
        if run is not None and run.request != request:  # not this call's request: dropped
            self._drop(run, rid, "its Prefill call carried another request")
            run = None
        if run is not None:
            run.expiry.cancel()
            self.metrics.express_starts.inc()
        else:
            run = self._start(request, context.invocation_metadata())
        params, carried, stream, rung, span = (run.params, run.carried, run.stream, run.rung,
                                               run.span)
        prompt = request.prompt_token_ids
        loop = self.instance.loop
        delivering = False  # True once the hand-off task owns releasing the blocks
        answered = False  # the caller has the last message (a cancel after it is no failure)
        self.instance.num_inflight += 1
        try:
            await run.submitted
            prompt_logprobs = None
            async for out in stream:
                final = out
                prompt_logprobs = out.prompt_logprobs or prompt_logprobs
            if len(final.output_token_ids) == len(carried):
                raise InvalidRequestError("the request's delivered tokens already end it")
            ends = _ends(final, params, carried)
            m = final.metrics
            self.metrics.observe_prefilled(m)
            tracing.record("prefill.queue", span, m.arrival_time, m.first_scheduled_time)
            tracing.record("prefill.compute", span, m.first_scheduled_time, m.first_token_time,
                           {"splitserve.cached_tokens": final.num_cached_tokens})
            first_token = final.output_token_ids[len(carried)]
            handoff = None
            if not ends:  # started first: the checksum runs while the first token is written
                first_token_unix_s = time.time() - (time.monotonic() - m.first_token_time)
                handoff = self._spawn(self._hand_off(
                    rid, final.held_block_ids, len(prompt) + len(carried), final.block_hashes,
                    first_token, first_token_unix_s, request.decode_address, span,
                    rung.get(rid)))
                self.handing_off.add(rid)
                handoff.add_done_callback(lambda _: self.handing_off.discard(rid))
                delivering = True
            answered = handoff is None
            if answered:  # ended before the last message: a caller that cancels once it has
                span.end()  # the message may stop this generator at the yield (or never resume it)
            yield self._first_response(rid, final, params, carried, prompt_logprobs)
            if handoff is None:
                self._spawn(self.prefixes.add(final.block_hashes))
                return
            accepted, deliver_ms = await asyncio.shield(handoff)
            # The prefix index only steers later requests: updated after the handoff.
            self._spawn(self.prefixes.add(final.block_hashes))
            answered = True
            span.end()  # before the last message, as above
            yield prefill_pb2.PrefillResponse(request_id=rid, delivered=accepted,
                                              deliver_ms=deliver_ms,
                                              instance_id=self.instance.instance_id)
        except BaseException as e:
            if not answered:
                tracing.failed(span, repr(e))
            raise
        finally:
            if span.is_recording():
                span.end()
            self.instance.num_inflight -= 1
            if not delivering:  # ended, cancelled or failed before delivering: release now
                loop.abort(rid)

    def _start(self, request: prefill_pb2.PrefillRequest, trace_metadata,
               reply_to: bytes = b"") -> _Run:
        """Validate the request and submit its prompt (the engine's verdict comes in
        `submitted`). reply_to: an express start's gateway (b"": none), sent the first token
        from the engine thread (not with prompt_logprobs, which may span several outputs)."""
        rid = request.request_id
        if not rid:
            raise InvalidRequestError("request_id must not be empty")
        if not request.decode_address:
            raise InvalidRequestError("decode_address must name the decode service that waits")
        params = params_from_pb(request.params)
        prompt = list(request.prompt_token_ids)
        carried = list(request.output_token_ids)  # a migrated request's delivered tokens
        # One choice here whatever n: the decode service forks the others from the KV.
        first_only = dataclasses.replace(params, max_tokens=len(carried) + 1, n=1)
        stream = AsyncOutputStream()
        rung: dict[str, tuple[HandoffDescriptor, bool]] = {}  # filled by the sink, see _ringing
        early = (self.early_handoff and "cuda_ipc" in self.source.offers
                 and self.source.shards is None)
        early_rung: list[HandoffDescriptor] = []  # the early ring's descriptor, once it went out
        reply = (self._replying(rid, params, carried, reply_to)
                 if reply_to and params.prompt_logprobs is None else None)
        sink = (self._ringing(rid, params, carried, len(prompt), request.decode_address, reply,
                              stream, rung, early_rung) if self.source.shards is None
                else _chain(reply, stream))
        if early:
            address, num_tokens = request.decode_address, len(prompt) + len(carried)

            def ring_early(blocks: list[int], event: bytes) -> None:
                # Its descriptor lacks only the checksum and the block hashes, which the ring
                # at the first token brings (_ringing).
                desc = self.source.describe(rid, blocks, num_tokens, (), checksum=0)
                if self.deliveries.ring_early(desc, event, address):
                    early_rung.append(desc)

            self.instance.loop.engine.kv.watch(rid, ring_early)
        span = tracing.start("prefill", tracing.context_from(trace_metadata),
                             kind=tracing.SpanKind.SERVER,
                             attributes={"splitserve.request_id": rid,
                                         "splitserve.prompt_tokens": len(prompt)})
        try:
            submitted = asyncio.wrap_future(self.instance.loop.submit(
                rid, prompt, first_only, sink, output_token_ids=carried, hold_kv=True))
        except BaseException as e:
            tracing.failed(span, repr(e))
            span.end()
            raise
        self._started[rid] = None
        while len(self._started) > STARTED_REMEMBERED:
            self._started.popitem(last=False)
        return _Run(request, params, carried, stream, rung, span, submitted)

    def on_express(self, message: prefill_pb2.ExpressPrefill, reply_to: bytes) -> None:
        """An express datagram (common/serving/express.py), on the event loop: start its prompt
        unless its call came first (or it is not valid: the call will say why)."""
        rid = message.request.request_id
        if not rid or rid in self._started or not self.instance.ready:
            return
        try:
            run = self._start(message.request, [("traceparent", message.traceparent)]
                              if message.traceparent else [], reply_to)
        except Exception:  # the Prefill call reports it
            return
        # A refused prompt's error is the call's to report; retrieved here so that a run no
        # call adopts does not log it as never retrieved.
        run.submitted.add_done_callback(lambda f: f.cancelled() or f.exception())
        run.expiry_s = max(0.0, min(message.timeout_s or ADOPT_WITHIN_S, ADOPT_WITHIN_S))
        run.expiry = asyncio.get_running_loop().call_later(run.expiry_s, self._expire, rid)
        self.express[rid] = run

    def _expire(self, rid: str) -> None:
        """An express start no call adopted in time."""
        run = self.express.pop(rid, None)
        if run is not None:
            self._drop(run, rid, f"no Prefill call came within {run.expiry_s:.1f} s")

    def _drop(self, run: _Run, rid: str, why: str) -> None:
        """An express start no call will adopt: aborted, which frees whatever it holds."""
        log.warning("request %s: started by the express lane, but %s: aborted", rid, why)
        if run.expiry is not None:
            run.expiry.cancel()
        tracing.failed(run.span, f"express start dropped: {why}")
        run.span.end()
        self.instance.loop.abort(rid)

    def _first_response(self, rid: str, final, params: SamplingParams, carried: list[int],
                        prompt_logprobs=None) -> prefill_pb2.PrefillResponse:
        """The first message of a Prefill stream (and an express reply), from the prompt's
        final output."""
        m = final.metrics
        ends = _ends(final, params, carried)
        return prefill_pb2.PrefillResponse(
            request_id=rid, first_token_id=final.output_token_ids[len(carried)],
            first_text=final.new_text,
            finish_reason=FINISH_TO_PB[final.finish_reason if ends else None],
            num_cached_tokens=final.num_cached_tokens,
            queue_ms=ms(m.first_scheduled_time - m.arrival_time),
            compute_ms=ms(m.first_token_time - m.first_scheduled_time),
            instance_id=self.instance.instance_id,
            first_logprobs=logprobs_to_pb(final.logprobs[0]) if final.logprobs else None,
            prompt_logprobs=prompt_logprobs_to_pb(prompt_logprobs))

    def _replying(self, rid: str, params: SamplingParams, carried: list[int], reply_to: bytes):
        """For an express start: the first token goes to the gateway from the engine thread the
        moment it is sampled (a sink's first part, see _chain)."""
        def replying(out) -> None:
            if (not isinstance(out, BaseException) and out.finished
                    and len(out.output_token_ids) > len(carried)):
                try:
                    self.lane.reply(reply_to, self._first_response(rid, out, params, carried))
                except Exception:  # never into the engine loop: the call carries it anyway
                    log.exception("request %s: the express reply failed", rid)

        return replying

    async def Abort(self, request: prefill_pb2.PrefillServiceAbortRequest,
                    context: grpc.aio.ServicerContext,
                    ) -> prefill_pb2.PrefillServiceAbortResponse:
        rid = request.request_id
        run = self.express.pop(rid, None)  # started by a datagram, its call not come (yet)
        if run is not None:
            run.expiry.cancel()
            run.span.end()
        if rid in self.handing_off:  # released when the delivery ends
            return prefill_pb2.PrefillServiceAbortResponse(found=True)
        return prefill_pb2.PrefillServiceAbortResponse(found=await asyncio.wrap_future(
            self.instance.loop.abort(rid)))

    async def Stats(self, request: prefill_pb2.PrefillServiceStatsRequest,
                    context: grpc.aio.ServicerContext,
                    ) -> prefill_pb2.PrefillServiceStatsResponse:
        return prefill_pb2.PrefillServiceStatsResponse(stats=await self.instance.stats())

    def _ringing(self, rid: str, params: SamplingParams, carried: list[int], num_prompt_tokens: int,
                 decode_address: str, reply, stream: AsyncOutputStream,
                 rung: dict[str, tuple[HandoffDescriptor, bool]],
                 early_rung: list[HandoffDescriptor]):
        """The engine's sink for a prompt (at TP 1): reply (the express reply, if any) gets
        the first token first; then, when the KV will be handed off, it is described and the
        decode service's doorbell rung right there on the engine thread, before the event loop
        hears of the first token (`stream`, last); `rung` passes the descriptor on to
        _hand_off. The checksum came back with the step on a GPU; on a CPU it is computed here
        (kernels/block_sums_cpu: one pass on this thread, 0.05 ms for a 64-token SmolLM2
        prompt, ~1-3 ms for 512), where the pool is written by this thread alone. When an
        early ring went out (early_rung, a GPU), the decode service holds its descriptor
        already: a short ring with the checksum goes even before the reply (tens of
        microseconds; the decode side's copy waits only for it), and the Deliver call's
        descriptor is that one completed. Anything failing here leaves the delivery to
        _hand_off."""
        def ringing(out) -> None:
            reached = time.time()
            handing_off = (not isinstance(out, BaseException) and out.finished
                           and out.held_block_ids is not None
                           and len(out.output_token_ids) > len(carried)
                           and not _ends(out, params, carried))
            kv = self.instance.loop.engine.kv
            checksum = rang = None
            early = (early_rung[0] if handing_off and early_rung
                     and early_rung[0].block_ids == list(out.held_block_ids) else None)
            if early is not None:
                try:
                    checksum = kv.checksum_of(rid, out.held_block_ids)
                    if checksum is not None:
                        rang = self.deliveries.ring_checksum(
                            rid, out.output_token_ids[len(carried)], checksum,
                            out.block_hashes, decode_address, _first_unix(out), reached)
                except Exception:  # never into the engine loop: rung the usual way below
                    log.exception("request %s: the short ring failed", rid)
            if reply is not None:
                reply(out)
            if handing_off:
                try:
                    blocks = out.held_block_ids
                    if checksum is None:
                        checksum = kv.checksum_of(rid, blocks)
                    desc = (early.completed(checksum, out.block_hashes)
                            if early is not None and checksum is not None else
                            self.source.describe(rid, blocks, num_prompt_tokens + len(carried),
                                                 out.block_hashes, checksum))
                    if rang is None:
                        rang = self.deliveries.ring(desc, out.output_token_ids[len(carried)],
                                                    decode_address, _first_unix(out), reached)
                    rung[rid] = (desc, rang)
                except Exception:  # never into the engine loop: _hand_off describes instead
                    log.exception("request %s: describing its KV on the engine thread failed",
                                  rid)
            stream(out)

        return ringing

    async def _hand_off(self, rid: str, block_ids: list[int], num_tokens: int,
                        block_hashes: list[int], first_token: int, first_token_unix_s: float,
                        decode_address: str, parent: tracing.Span,
                        rung: tuple[HandoffDescriptor, bool] | None = None,
                        ) -> tuple[bool, float]:
        """Checksum the held blocks and deliver them; (accepted, ms). Releases the blocks at its
        end whatever happens (Deliveries does once the call is made). rung: the descriptor the
        engine's sink made, and whether it rang the doorbell (see _ringing)."""
        start = time.monotonic()
        span = tracing.start("handoff.deliver", parent)
        args = (rid, block_ids, num_tokens, block_hashes)
        try:
            # On a GPU the engine queued the checksum behind the prompt's last step
            # (KVConnector.queue_checksum): here it is only read.
            checksum = (self.instance.loop.engine.kv.checksum_of(rid, block_ids)
                        if self.source.pool.is_cuda and rung is None else None)
            if rung is not None:
                desc = rung[0]
            elif self.source.pool.is_cuda:
                desc = self.source.describe(*args, checksum)
            else:
                desc = await asyncio.to_thread(self.source.describe, *args)
        except BaseException as e:
            self.instance.loop.abort(rid)
            tracing.failed(span, repr(e))
            span.end()
            raise
        described = time.monotonic()
        if span.is_recording():
            span.set_attributes({"splitserve.blocks": len(block_ids),
                                 "splitserve.bytes": handoff_bytes(desc, self.source.pool)})
        accepted, reason, _ = await self.deliveries.deliver(desc, first_token, decode_address,
                                                            tracing.metadata_for(span),
                                                            first_token_unix_s,
                                                            rung=rung is not None)
        done = time.monotonic()
        span.set_attributes({"splitserve.checksum_ms": ms(described - start),
                             "splitserve.accepted": accepted})
        if not accepted:
            tracing.failed(span, reason)
        span.end()
        log.debug("handoff %s: describe (checksum) %.2f ms, deliver %.2f ms", rid,
                  1e3 * (described - start), 1e3 * (done - described))
        return accepted, ms(done - start)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task


def _ends(final, params: SamplingParams, carried: list[int]) -> bool:
    """Whether the prompt's first token ends the request (then no KV is handed off): a stop,
    or the last token asked for; with n > 1 it ends choice 0 only and the others need the KV."""
    if params.n > 1:
        return False
    return final.finish_reason == "stop" or params.max_tokens == len(carried) + 1


def _first_unix(out) -> float:
    """When (time.time()) the engine sampled an output's first token."""
    return time.time() - (time.monotonic() - out.metrics.first_token_time)


def _chain(first, then):
    """A sink: first(out), if any, then then(out)."""
    if first is None:
        return then

    def chained(out) -> None:
        first(out)
        then(out)

    return chained
