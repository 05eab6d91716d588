"""Delivering a prompt's KV to the decode service that waits for it (DecodeService.Deliver).

Hold rule: a finished prompt's blocks are held (engine.kv.held, add_request's hold_kv) from its
last step until its Deliver call ends, and released then, whatever the answer: the decode side has
pulled and verified them (accepted), or will recompute (refused), or is gone. The call's deadline
(`--handoff-lease-s`) is the lease: a stuck decode service keeps the blocks that long at most,
and its pull must end before the deadline or it discards what it read (decode_service/handoff.py).
A delivery is never cut short from this side: when the Prefill call is cancelled or Abort is
called during it, the blocks are released after it ends, so a pull never reads released blocks.

One channel per decode address, kept open and reused by every delivery. Before each call the
decode service's doorbell is rung (common/serving/doorbell.py): on one host its pull starts
without waiting for the call, whose rules above stay as they are; the ring's deadline is taken
before the call starts, so it is never later than the call's.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time

import grpc

from common.registry import HandoffDescriptor
from common.serving import grpc_util
from common.serving.doorbell import DoorbellSender
from common.serving.engine_loop import EngineLoop
from common.serving.metrics import PrefillMetrics
from common.serving.tls import PLAINTEXT, TlsConfig
from protos.splitserve.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger("splitserve.prefill.delivery")


class Deliveries:
    def __init__(self, loop: EngineLoop, lease_s: float, metrics: PrefillMetrics,
                 tls: TlsConfig = PLAINTEXT):
        """tls: this service's TlsConfig, with which it dials decode services."""
        self.loop = loop
        self.lease_s = lease_s
        self.metrics = metrics
        self.tls = tls
        self.inflight: dict[str, asyncio.Task] = {}
        self.doorbell = DoorbellSender()
        self._stubs: dict[str, decode_pb2_grpc.DecodeServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def ring(self, desc: HandoffDescriptor, first_token_id: int, address: str,
             first_token_unix_s: float, output_unix_s: float = 0.0) -> bool:
        """Any thread: ring the doorbell of the decode service at address for this delivery.
        False when no doorbell heard it. output_unix_s: when the engine's output reached the
        caller, for the decode side's debug log of the critical path (_send)."""
        rang = self._send(address, {
            "request_id": desc.request_id, "first_token_id": first_token_id,
            "first_token_unix_s": first_token_unix_s, "output_unix_s": output_unix_s,
            "descriptor_json": desc.to_json()})
        if first_token_unix_s and log.isEnabledFor(logging.DEBUG):
            log.debug("handoff %s: %s %.2f ms after the first token", desc.request_id,
                      "doorbell rung" if rang else "no doorbell",
                      1e3 * (time.time() - first_token_unix_s))
        return rang

    def ring_early(self, desc: HandoffDescriptor, event: bytes, address: str) -> bool:
        """Engine thread, when the step that writes the prompt's last KV is launched: the
        decode service at address may start its copy of desc's blocks (its cuda_ipc offer) the
        moment the interprocess `event` completes; desc lacks the checksum and the block
        hashes, which ring_checksum() brings at the first token. False when no doorbell heard
        it."""
        return self._send(address, {
            "request_id": desc.request_id, "early": True, "descriptor_json": desc.to_json(),
            "event": base64.b64encode(event).decode("ascii")})

    def ring_checksum(self, request_id: str, first_token_id: int, checksum: int,
                      block_hashes: list[int], address: str, first_token_unix_s: float,
                      output_unix_s: float) -> bool:
        """Engine thread, at the first token of a prompt whose early ring went out: ring() but
        without the descriptor, which the early ring carried (what it lacked comes here). A
        decode service that did not keep it waits for the Deliver call, which carries it all."""
        return self._send(address, {
            "request_id": request_id, "first_token_id": first_token_id, "checksum": checksum,
            "block_hashes": block_hashes, "first_token_unix_s": first_token_unix_s,
            "output_unix_s": output_unix_s})

    def _send(self, address: str, message: dict) -> bool:
        """One ring: its deadline is the lease from now (so before the Deliver call's, which
        starts later); the moment of sending goes with it (the decode's debug breakdown)."""
        now = time.time()
        return self.doorbell.ring(address, {**message, "deadline_unix_s": now + self.lease_s,
                                            "sent_unix_s": now})

    async def deliver(self, desc: HandoffDescriptor, first_token_id: int, address: str,
                      metadata: tuple[tuple[str, str], ...] = (),
                      first_token_unix_s: float = 0.0, rung: bool = False,
                      ) -> tuple[bool, str, float]:
        """Deliver held blocks and release them: (accepted, reason, ms). Cancelling the caller
        leaves the delivery running; it releases the blocks when it ends. metadata: sent with
        the call (the trace context). first_token_unix_s: when the first token was sampled
        (time.time()), for the decode side's measure of the critical path. rung: the doorbell
        was tried already (ring())."""
        rid = desc.request_id
        task = asyncio.get_running_loop().create_task(self._deliver(
            desc, first_token_id, address, metadata, first_token_unix_s, rung))
        self.inflight[rid] = task
        task.add_done_callback(lambda _: self.inflight.pop(rid, None))
        return await asyncio.shield(task)

    async def _deliver(self, desc: HandoffDescriptor, first_token_id: int, address: str,
                       metadata: tuple[tuple[str, str], ...], first_token_unix_s: float,
                       rung: bool) -> tuple[bool, str, float]:
        start = time.monotonic()
        try:
            if not rung:
                self.ring(desc, first_token_id, address, first_token_unix_s)
            reply = await self._stub(address).Deliver(
                decode_pb2.DeliverRequest(request_id=desc.request_id,
                                          first_token_id=first_token_id,
                                          descriptor_json=desc.to_json(),
                                          first_token_unix_s=first_token_unix_s),
                timeout=self.lease_s, metadata=metadata)
            accepted, reason = reply.accepted, reply.reason
        except grpc.aio.AioRpcError as e:
            accepted, reason = False, f"Deliver to {address}: {e.code().name}: {e.details()}"
        except Exception as e:  # never leave the blocks held
            log.exception("delivering request %s to %s failed", desc.request_id, address)
            accepted, reason = False, f"Deliver to {address}: {e}"
        finally:
            self.loop.abort(desc.request_id)  # releases the held blocks
        (self.metrics.handoffs if accepted else self.metrics.delivery_failures).inc()
        if not accepted:
            log.info("request %s: KV not taken by %s (%s)", desc.request_id, address, reason)
        return accepted, reason, 1e3 * (time.monotonic() - start)

    def delivering(self, request_id: str) -> bool:
        return request_id in self.inflight

    def _stub(self, address: str) -> decode_pb2_grpc.DecodeServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc_util.channel(address, self.tls)
            self._channels.append(channel)
            stub = self._stubs[address] = decode_pb2_grpc.DecodeServiceStub(channel)
        return stub

    async def close(self) -> None:
        """At shutdown: let the deliveries in flight end (each releases its blocks)."""
        await asyncio.gather(*self.inflight.values(), return_exceptions=True)
        for channel in self._channels:
            await channel.close(grace=1.0)
        self._channels.clear()
        self._stubs.clear()
        self.doorbell.close()
