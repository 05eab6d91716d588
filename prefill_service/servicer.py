"""The Prefill gRPC service: a thin adapter from PrefillRequest to the engine and back.

A prompt runs with the client's sampling settings but max_tokens=1 and hold_blocks=True. Its first
token goes out at once; unless it ends the request, the blocks stay held under a handoff record
(holds.py), published after the first token so that checksumming does not delay it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from common.errors import InvalidRequestError
from common.kv_transport.source import KVSource
from common.serving.engine_loop import AsyncOutputStream
from common.serving.instance import ServiceInstance
from common.serving.metrics import PrefillMetrics
from common.serving.proto_convert import FINISH_TO_PB, logprobs_to_pb, ms, params_from_pb
from prefill_service.holds import HandoffHolds
from prefill_service.prefix_sync import PrefixSync
from protos.splitserve.v1 import prefill_pb2, prefill_pb2_grpc, types_pb2

log = logging.getLogger("splitserve.prefill")


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, instance: ServiceInstance, source: KVSource, holds: HandoffHolds,
                 prefixes: PrefixSync, lease_s: float, metrics: PrefillMetrics):
        self.instance = instance
        self.source = source
        self.holds = holds
        self.prefixes = prefixes
        self.lease_s = lease_s
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()

    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext,
                      ) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        rid = request.request_id
        if not rid:
            raise InvalidRequestError("request_id must not be empty")
        params = params_from_pb(request.params)
        prompt = list(request.prompt_token_ids)
        carried = list(request.output_token_ids)  # a migrated request's delivered tokens
        first_only = dataclasses.replace(params, max_tokens=len(carried) + 1, hold_blocks=True)
        loop = self.instance.loop
        stream = AsyncOutputStream()
        outcome = "failed"  # -> "ended" (first token ends it) or "held" (handoff published)
        self.instance.num_inflight += 1
        try:
            await asyncio.wrap_future(loop.submit(rid, prompt, first_only, stream,
                                                  output_token_ids=carried))
            async for out in stream:
                final = out
            if len(final.output_token_ids) == len(carried):
                raise InvalidRequestError("the request's delivered tokens already end it")
            ends = final.finish_reason == "stop" or params.max_tokens == len(carried) + 1
            m = final.metrics
            self.metrics.observe_prefilled(m)
            yield prefill_pb2.PrefillResponse(
                request_id=rid, first_token_id=final.output_token_ids[len(carried)],
                first_text=final.new_text,
                finish_reason=FINISH_TO_PB[final.finish_reason if ends else None],
                num_cached_tokens=final.num_cached_tokens,
                queue_ms=ms(m.first_scheduled_time - m.arrival_time),
                compute_ms=ms(m.first_token_time - m.first_scheduled_time),
                instance_id=self.instance.instance_id,
                first_logprobs=logprobs_to_pb(final.logprobs[0]) if final.logprobs else None)
            self._spawn(self.prefixes.add(final.block_hashes))
            if ends:
                outcome = "ended"
                return
            start = time.monotonic()
            await asyncio.to_thread(self._publish, rid, final.held_block_ids,
                                    len(prompt) + len(carried), final.block_hashes)
            # Watched only once published: before that its record reads as expired.
            self.holds.add(rid)
            self.metrics.handoffs.inc()
            outcome = "held"
            yield prefill_pb2.PrefillResponse(request_id=rid, handoff_id=rid,
                                              publish_ms=ms(time.monotonic() - start),
                                              instance_id=self.instance.instance_id)
        finally:
            self.instance.num_inflight -= 1
            if outcome == "failed":  # cancelled or failed: withdraw the record, free the blocks
                self._spawn(self.holds.cancel(rid))
            elif outcome == "ended":  # nothing to hand off: release the hold now
                loop.abort(rid)

    async def Abort(self, request: types_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> types_pb2.AbortResponse:
        return types_pb2.AbortResponse(found=await self.holds.cancel(request.request_id))

    async def Stats(self, request: types_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> types_pb2.InstanceStats:
        return await self.instance.stats()

    def _publish(self, rid: str, block_ids: list[int], num_tokens: int,
                 block_hashes: list[int]) -> None:
        """Describe (checksum) and publish a handoff, in one hop off the event loop."""
        start = time.monotonic()
        desc = self.source.describe(rid, block_ids, num_tokens, block_hashes)
        described = time.monotonic()
        self.instance.registry.publish_handoff(desc, self.lease_s)
        log.debug("handoff %s: describe (checksum) %.2f ms, publish %.2f ms", rid,
                  1e3 * (described - start), 1e3 * (time.monotonic() - described))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
