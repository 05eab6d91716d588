"""Taking over a prefilled request: blocks reserved when its Decode call arrives, filled when the
prefill service delivers the KV, verified, then handed to the engine.

    Decode call (from the gateway):  take(rid, n, prefill) -> reserve n blocks -> wait ...
    Deliver call (from the prefill):   deliver(rid, desc)  -> pull + verify into them -> reply
    Decode call:                                   ... -> Taken(blocks) -> Prefilled -> engine

The gateway sends the Decode and Prefill calls at the same moment, so the reservation (which
waits for the engine thread between two steps) overlaps the prefill's queueing and compute, and
nothing but the pull and its checksum lies between the prefill's first token and the request
joining the batch: no registry round trip, no second call from the gateway. Either call may
arrive first (a cached prompt prefills in a millisecond); Deliver waits up to `wait_s` for its
Decode call.

Leases: the prefill side holds its blocks for the Deliver call only, and that call's deadline is
its lease: the pull must end (and its KV be verified) with `DEADLINE_MARGIN_S` to spare, or the KV
is discarded, since after the deadline the source may reuse its blocks. The reservation here
lives as long as the Decode call; while it waits, the prefill instance's registry record (kept
alive by its heartbeat) is checked every `peer_check_s`, and when it is gone the reservation is
freed and the request ends UNAVAILABLE (the gateway migrates it).

Block ownership: the reserved blocks belong to the slot until take() returns them (the caller
gives them to the engine with Prefilled). Whoever ends the slot otherwise (the Decode call
cancelled, the pull failed, the peer gone) frees them, but only after the pull thread stopped
writing into them.

Doorbell (common/serving/doorbell.py): on one host the prefill service rings before it calls
Deliver; ring() starts the same pull at once, for a request whose blocks are reserved and which
nobody pulls yet, and the Deliver call that follows answers with that pull's outcome (`rung`
keeps it for the call). A ring never frees or takes anything the Deliver call would not: it is
the same deliver() with the ring's deadline, which ends before the call's can.

Tensor parallelism: every rank pulls its own shard into the same block ids, rank 0 here and the
others on their threads (common/engine/rank_kv.py), and the pull is accepted when all verified;
blocks are reserved and freed on rank 0's block manager, once for every rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import redis
import torch

from common.engine.rank_kv import RankShards
from common.errors import (
    HandoffNotFoundError,
    InvalidRequestError,
    PeerGoneError,
    RankFailure,
    TransferError,
)
from common.kv_transport.blocks import handoff_bytes
from common.kv_transport.checksum import prepare
from common.kv_transport.select import KVReceiver
from common.registry import HandoffDescriptor, Registry
from common.serving import tracing
from common.serving.engine_loop import EngineLoop
from common.serving.metrics import DecodeMetrics
from common.serving.tls import PLAINTEXT, TlsConfig

log = logging.getLogger("splitserve.decode.handoff")

DEADLINE_MARGIN_S = 0.05  # a pull ending closer than this to the Deliver deadline is discarded


@dataclass(slots=True)
class Taken:
    """A prefilled request's KV as take() hands it over. block_ids None: the KV could not be used
    (failure says why) and the prompt is recomputed here; the first token stays an output."""
    block_ids: list[int] | None
    first_token_id: int
    reserve_ms: float
    handoff_ms: float
    failure: str = ""
    first_token_unix_s: float = 0.0  # when the prefill sampled the first token (0: unknown)
    # take()'s admit callback ran: the engine owns block_ids (its future: the submission), and
    # when (time.time()): the end of the handoff's critical path.
    admitted: Future | None = None
    admitted_unix_s: float = 0.0


@dataclass(slots=True, eq=False)
class _Slot:
    """One request between its Decode call and its delivery (see the module docstring)."""
    request_id: str
    reserved: asyncio.Future          # (blocks, event) once reserved; cancelled: the call left
    delivered: asyncio.Future         # Taken, set by deliver()
    blocks: list[int] = field(default_factory=list)  # reserved, not yet handed to anyone
    pulling: bool = False             # the pull thread writes into blocks
    claimed: bool = False             # a delivery (call or doorbell) has begun on this slot
    admit: Callable[[Taken], Future] | None = None  # take()'s, called when the KV is verified
    ended: bool = False               # the Decode call left: nobody takes the blocks
    reserve_ms: float = 0.0           # how long reserving took (Taken.reserve_ms)


class _PullAttributes:
    """Stands for a span in a pull the doorbell started (no call, so no span yet): keeps the
    attributes the pull sets, for the span of the Deliver call that answers with it."""

    def __init__(self) -> None:
        self.attributes: dict = {}

    def set_attributes(self, attributes: dict) -> None:
        self.attributes.update(attributes)


class HandoffInbox:
    def __init__(self, registry: Registry, loop: EngineLoop, timeout_s: float,
                 metrics: DecodeMetrics, *, wait_s: float = 5.0, peer_check_s: float = 1.0,
                 tls: TlsConfig = PLAINTEXT):
        """timeout_s: the longest a pull may take. tls: this service's TlsConfig; grpc pulls dial
        prefill services with it."""
        self.registry = registry
        self.loop = loop
        self.wait_s = wait_s
        self.peer_check_s = peer_check_s
        self.receiver = KVReceiver(timeout_s=timeout_s, tls=tls)
        prepare(loop.engine.kv_cache)  # the CPU checksum kernel built now, not on a handoff
        # Transports keep per-source state and are used by one thread at a time.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        self.slots: dict[str, _Slot] = {}
        # Requests whose Decode call ended without its KV, and when: a delivery that comes
        # later is refused at once instead of waiting wait_s for a call that will not come.
        self.gone: dict[str, float] = {}
        self.transports_used: dict[str, int] = {}
        self.metrics = metrics
        self.shards = RankShards.of(loop.engine)  # the other tensor-parallel ranks, if any
        # Pulls a doorbell started, by request id, until the Deliver call for it comes (or a
        # while after: the prefill may be gone), with what the pull would put on a span.
        self.rung: dict[str, tuple[asyncio.Task, _PullAttributes]] = {}

    @property
    def pending(self) -> set[str]:
        """Requests with blocks reserved that wait for (or are receiving) their KV."""
        return {rid for rid, slot in self.slots.items() if slot.reserved.done()}

    def _slot(self, request_id: str) -> _Slot:
        slot = self.slots.get(request_id)
        if slot is None:
            aio = asyncio.get_running_loop()
            slot = self.slots[request_id] = _Slot(request_id, aio.create_future(),
                                                  aio.create_future())
        return slot

    # ---- the Decode call's side ---------------------------------------------------------------
    async def take(self, request_id: str, num_blocks: int, prefill_instance_id: str,
                   admit: Callable[[Taken], Future] | None = None) -> Taken:
        """Reserve num_blocks, wait for the delivery, and return what it brought (the caller
        owns Taken.block_ids). Raises PeerGoneError when the prefill instance leaves the registry
        first; cancelling frees the reservation.

        admit: called the moment a delivered KV is verified, on the event loop's thread, with
        the Taken (the caller's engine submission: it then owns the blocks, and Taken.admitted
        is its future), so the request reaches the engine without waiting for this coroutine
        to be resumed; not called for a KV that cannot be used."""
        start = time.monotonic()
        slot = self._slot(request_id)
        if slot.reserved.done():
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        slot.admit = admit
        if slot.delivered.done():  # the delivery came first and gave up waiting: recompute
            self.slots.pop(request_id, None)
            return slot.delivered.result()
        try:
            blocks, after = await asyncio.wrap_future(
                self.loop.call(lambda e: e.kv.reserve_for_copy(num_blocks)))
        except BaseException:
            self._drop(slot)
            raise
        slot.blocks = blocks
        slot.reserve_ms = reserve_ms = 1e3 * (time.monotonic() - start)
        slot.reserved.set_result((blocks, after))
        try:
            while True:
                try:
                    taken = await asyncio.wait_for(asyncio.shield(slot.delivered),
                                                   self.peer_check_s)
                    break
                except TimeoutError:
                    await self._check_peer(request_id, prefill_instance_id)
        except BaseException:
            self._drop(slot)
            raise
        self.slots.pop(request_id, None)
        if slot.blocks:  # reserved, never pulled into (the delivery gave up waiting for them)
            self._free(slot.blocks)
            slot.blocks = []
        taken.reserve_ms = reserve_ms
        return taken

    async def _check_peer(self, request_id: str, prefill_instance_id: str) -> None:
        try:
            alive = await asyncio.to_thread(self.registry.get_instance, prefill_instance_id)
        except redis.RedisError as e:  # the registry restarting: the peer is given the benefit
            log.warning("request %s: checking prefill %s failed: %s", request_id,
                        prefill_instance_id, e)
            return
        if alive is None:
            self.metrics.handoff_failures("peer_gone").inc()
            raise PeerGoneError(
                f"prefill instance {prefill_instance_id} left the registry before delivering "
                f"the KV of request {request_id!r}")

    def _drop(self, slot: _Slot) -> None:
        """The Decode call left: free the reservation now, or (deliver() does) after the pull
        in flight."""
        slot.ended = True
        now = time.monotonic()
        self.gone = {rid: t for rid, t in self.gone.items() if now - t < self.wait_s}
        self.gone[slot.request_id] = now
        if not slot.reserved.done():
            slot.reserved.cancel()
        if self.slots.get(slot.request_id) is slot:
            del self.slots[slot.request_id]
        if slot.pulling:
            return
        # Reserved and not pulled into, and (disjoint) delivered and not yet taken (unless
        # admitted: then the engine owns them, and the caller's abort frees them).
        blocks, slot.blocks = slot.blocks, []
        if slot.delivered.done() and slot.delivered.result().admitted is None:
            blocks += slot.delivered.result().block_ids or []
        if blocks:
            self._free(blocks)

    def _free(self, blocks: list[int]) -> None:
        self.loop.call(lambda e: e.kv.free(blocks))

    # ---- the doorbell ------------------------------------------------------------------------
    def ring(self, message: dict) -> None:
        """A doorbell's datagram (on the event loop's thread): start the pull now if the
        request's blocks are reserved and nobody pulls them yet; else leave it to Deliver."""
        rid = message.get("request_id")
        slot = self.slots.get(rid) if isinstance(rid, str) else None
        if (slot is None or slot.claimed or not slot.reserved.done()
                or slot.reserved.cancelled() or slot.delivered.done() or slot.ended):
            return
        try:
            desc = HandoffDescriptor.from_json(message["descriptor_json"])
            first_token_id = int(message["first_token_id"])
            remaining = float(message["deadline_unix_s"]) - time.time()
            first_token_unix_s = float(message.get("first_token_unix_s", 0.0))
        except (KeyError, TypeError, ValueError) as e:
            log.warning("request %s: a doorbell ring without a usable descriptor: %s", rid, e)
            return
        if remaining <= DEADLINE_MARGIN_S or desc.request_id != rid:
            return
        if first_token_unix_s and log.isEnabledFor(logging.DEBUG):
            log.debug("handoff %s: doorbell heard %.2f ms after the first token", rid,
                      1e3 * (time.time() - first_token_unix_s))
        slot.claimed = True
        pulled = _PullAttributes()  # the Deliver call's span gets them (deliver())
        task = asyncio.get_running_loop().create_task(self._deliver(
            rid, desc, first_token_id, remaining, pulled, first_token_unix_s))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read by Deliver
        self.rung[rid] = (task, pulled)
        self.metrics.handoffs_rung.inc()
        # Forgotten if its Deliver call never comes (the prefill died after ringing).
        asyncio.get_running_loop().call_later(
            max(remaining, self.wait_s) + 1.0,
            lambda: self.rung.pop(rid, None) if self.rung.get(rid, (None,))[0] is task
            else None)

    # ---- the Deliver call's side --------------------------------------------------------------
    async def deliver(self, request_id: str, desc: HandoffDescriptor, first_token_id: int,
                      time_remaining_s: float | None, span: tracing.Span = tracing.NO_SPAN,
                      first_token_unix_s: float = 0.0) -> tuple[bool, str]:
        """Pull a delivered KV into the reserved blocks and verify it: (accepted, reason). When
        not accepted the waiting Decode call, if any, recomputes the prompt. span: the pull's
        transport, bytes and rate go on it (common/serving/tracing.py). first_token_unix_s:
        DeliverRequest's, passed on in Taken. When a doorbell already started the pull, its
        outcome (raised errors included) is this call's."""
        rung = self.rung.pop(request_id, None)
        if rung is not None:
            task, pulled = rung
            try:
                return await asyncio.shield(task)
            finally:
                span.set_attributes({**pulled.attributes, "splitserve.doorbell": True})
        return await self._deliver(request_id, desc, first_token_id, time_remaining_s, span,
                                   first_token_unix_s)

    async def _deliver(self, request_id: str, desc: HandoffDescriptor, first_token_id: int,
                       time_remaining_s: float | None, span: tracing.Span | _PullAttributes,
                       first_token_unix_s: float) -> tuple[bool, str]:
        arrived = time.monotonic()
        if request_id in self.gone:
            raise HandoffNotFoundError(f"request {request_id!r} is no longer waiting for its KV")
        slot = self._slot(request_id)
        slot.claimed = True
        try:
            if slot.reserved.done() and not slot.reserved.cancelled():
                blocks, after = slot.reserved.result()  # the usual case: no loop turn here
            else:
                blocks, after = await asyncio.wait_for(asyncio.shield(slot.reserved),
                                                       self.wait_s)
        except asyncio.CancelledError:
            if not slot.reserved.cancelled():
                raise  # this call was cancelled
            raise HandoffNotFoundError(f"request {request_id!r} is no longer waiting for its KV"
                                       ) from None
        except TimeoutError:
            # No reservation in time: the Decode call (if it comes, or is still reserving)
            # recomputes the prompt; the prefill side releases its blocks.
            if not slot.delivered.done():
                slot.delivered.set_result(Taken(None, first_token_id, 0.0, 0.0,
                                                f"the delivery waited {self.wait_s} s for "
                                                "the blocks to be reserved"))
            if not slot.reserved.done():  # forget it if no Decode call ever comes
                asyncio.get_running_loop().call_later(
                    60 * self.wait_s, lambda: self.slots.pop(request_id, None)
                    if self.slots.get(request_id) is slot and not slot.reserved.done() else None)
            raise HandoffNotFoundError(f"no Decode call waits for request {request_id!r}"
                                       ) from None
        if slot.delivered.done() or slot.ended:
            raise HandoffNotFoundError(f"request {request_id!r} is no longer waiting for its KV")
        deadline = None if time_remaining_s is None else arrived + time_remaining_s
        slot.pulling = True
        try:
            if self.loop.engine.kv_cache.is_cuda and desc.source_host_id == self.receiver.host:
                # On one host a GPU pull is a copy and a checksum kernel, ~0.5 ms: done here, as
                # the hop to the pull thread and back cost more (waiting for the GIL).
                reason = self._pull(desc, blocks, after, deadline, span)
            else:
                reason = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._pull, desc, blocks, after, deadline, span)
        finally:
            slot.pulling = False
            slot.blocks = []  # from here on this call hands them on or frees them
        handoff_ms = 1e3 * (time.monotonic() - arrived)
        if slot.ended:  # the Decode call left during the pull
            self._free(blocks)
            return False, f"request {request_id!r} ended during the pull"
        if reason:
            self._free(blocks)
            log.warning("request %s: %s; recomputing its prompt here", request_id, reason)
            slot.delivered.set_result(Taken(None, first_token_id, 0.0, handoff_ms, reason))
            return False, reason
        taken = Taken(blocks, first_token_id, slot.reserve_ms, handoff_ms,
                      first_token_unix_s=first_token_unix_s)
        if slot.admit is not None:
            taken.admitted_unix_s = time.time()
            taken.admitted = slot.admit(taken)
        slot.delivered.set_result(taken)
        return True, ""

    def _pull(self, desc: HandoffDescriptor, blocks: list[int], after: torch.cuda.Event | None,
              deadline: float | None, span: tracing.Span | _PullAttributes) -> str:
        """The pull thread's part: copy and verify; "" when the KV may be used, else why not."""
        start = time.monotonic()
        pool = self.loop.engine.kv_cache
        try:
            if self.shards is None and desc.tensor_parallel_size != 1:
                raise TransferError(
                    f"handoff {desc.request_id}: the prefill instance runs at tensor parallel "
                    f"size {desc.tensor_parallel_size}, this decode instance at 1; the KV moves "
                    "rank to rank between instances of one size only")
            if self.shards is None:
                name = self.receiver.pull(desc, pool, blocks, after)
            else:
                name = self.shards.pull_all(
                    desc, blocks, self.receiver.timeout_s, self.receiver.host,
                    lambda rank0: self.receiver.pull(rank0, pool, blocks, after),
                    self.receiver.tls)
        except (TransferError, RankFailure) as e:  # RankFailure: a rank died mid-pull
            self.metrics.handoff_failures("transfer").inc()
            return str(e)
        done = time.monotonic()
        if deadline is not None and done > deadline - DEADLINE_MARGIN_S:
            self.metrics.handoff_failures("lease_expired").inc()
            return (f"handoff {desc.request_id}: the pull ended {1e3 * (done - deadline):+.1f} ms "
                    f"from the delivery's deadline; the source may have reused its blocks")
        self.transports_used[name] = self.transports_used.get(name, 0) + 1
        nbytes = handoff_bytes(desc, pool)
        self.metrics.observe_handoff(name, nbytes, done - start)
        span.set_attributes({"splitserve.transport": name, "splitserve.blocks": len(blocks),
                             "splitserve.bytes": nbytes,
                             "splitserve.gb_per_s": nbytes / 1e9 / max(done - start, 1e-9)})
        log.debug("handoff %s via %s: pull+verify %.2f ms", desc.request_id, name,
                  1e3 * (done - start))
        return ""

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.receiver.close()
