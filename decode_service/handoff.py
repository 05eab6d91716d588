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
import base64
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import redis
import torch

from common.engine.rank_kv import RankShards
from common.errors import (
    EngineLoopStopped,
    HandoffNotFoundError,
    InvalidRequestError,
    PeerGoneError,
    RankFailure,
    TransferError,
)
from common.kv_transport.base import check_geometry
from common.kv_transport.blocks import handoff_bytes, transfer_stream, waiting_streams
from common.kv_transport.checksum import combine, prepare
from common.kv_transport.select import KVReceiver
from common.registry import HandoffDescriptor, Registry
from common.serving import tracing
from common.serving.engine_loop import EngineLoop
from common.serving.metrics import DecodeMetrics
from common.serving.tls import PLAINTEXT, TlsConfig

log = logging.getLogger("splitserve.decode.handoff")

DEADLINE_MARGIN_S = 0.05  # a pull ending closer than this to the Deliver deadline is discarded
EARLY_WAIT_S = 0.05  # how long a delivery waits for its early copy to be queued, then pulls
STRANDED_WARN_S = 30.0  # blocks still written by a dropped early copy after this: logged


def _settle(future: asyncio.Future, error: BaseException) -> None:
    """Fail a future unless it is done (loop thread)."""
    if not future.done():
        future.set_exception(error)
        future.exception()  # retrieved: whoever needs it reads it again


def _resolve(future: asyncio.Future, result: object) -> None:
    """Set a future's result unless it is done (loop thread)."""
    if not future.done():
        future.set_result(result)


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
    # The handoff's moments on its way here (time.time(), by name, in the order they came:
    # ring sent, heard, early event seen and copy queued, verified), for the debug log's
    # breakdown of the critical path (DecodeServicer).
    marks: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Early:
    """An early ring's copy. A thread prepares it (source opened, ids uploaded, a host buffer
    for the sums) and queues the copy with its sums into the reserved blocks behind the prefill
    step's interprocess event: by default at once, on a stream of its own that waits for the
    event on the device (--early-copy-on-device), else once the thread has seen the
    event complete. `copy` is then (pinned host sums, event when copied); `failed` when it
    could not. `queued` follows on the loop's thread, for a delivery that waits for it. `lock`
    orders the thread's queueing against drop() (loop thread); the rest is loop-thread state
    but for the thread's marks."""
    # The handoff's descriptor but for its checksum and block hashes, which the short ring
    # at the first token brings (HandoffDescriptor.completed).
    desc: HandoffDescriptor
    queued: asyncio.Future
    lock: threading.Lock = field(default_factory=threading.Lock)
    copy: tuple[torch.Tensor, torch.cuda.Event] | None = None  # set once, under lock
    failed: bool = False              # the thread could not queue it (queued says why)
    dropped: bool = False             # nobody will use it: it must not be queued any more
    # The thread's moments (time.time(), by name: event seen, launching, kernel launched,
    # queued), for Taken.marks once the copy is used.
    marks: dict[str, float] = field(default_factory=dict)

    @property
    def block_ids(self) -> list[int]:  # the source's blocks
        return self.desc.block_ids

    @property
    def offer(self) -> dict:  # the source pool's cuda_ipc entry
        return self.desc.transports["cuda_ipc"]

    @property
    def through(self) -> bool:
        """The thread is done with it: the copy is queued, or will not be."""
        return self.copy is not None or self.failed

    def matches(self, desc: HandoffDescriptor) -> bool:
        ipc = desc.transports.get("cuda_ipc") or {}
        return (list(desc.block_ids) == self.block_ids
                and ipc.get("handle") == self.offer.get("handle"))

    def drop(self) -> torch.cuda.Event | None:
        """Never queued from now on. A copy queued already still writes the slot's blocks: its
        event when it has not completed (it may wait on the device for a source that died
        during its step, maybe for good): nothing may use or free those blocks before it
        completes. Loop thread."""
        with self.lock:
            self.dropped = True
            copy = self.copy
        if not self.queued.done():
            self.queued.cancel()
        return None if copy is None or copy[1].query() else copy[1]


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
    early: _Early | None = None       # an early doorbell ring's copy (see _ring_early)
    early_ring: dict | None = None    # an early ring that came before the reservation
    # A dropped early copy not yet completed: it still writes `blocks` (_Early.drop).
    writing: torch.cuda.Event | None = None
    marks: dict[str, float] = field(default_factory=dict)  # Taken.marks, gathered


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
                 tls: TlsConfig = PLAINTEXT, early_copy_on_device: bool = True,
                 admit_wait_ms: float = 0.0):
        """timeout_s: the longest a pull may take. tls: this service's TlsConfig; grpc pulls dial
        prefill services with it. early_copy_on_device: an early ring's copy is queued at once
        behind a wait on the device for the prefill's event (else when a thread has seen the
        event complete). admit_wait_ms: after admitting a request to an idle engine on a GPU,
        the admitting thread waits up to this long for the engine's next launch (its first
        step), leaving the engine's thread the GIL; 0: never."""
        self.registry = registry
        self.loop = loop
        self.early_copy_on_device = early_copy_on_device
        self.admit_wait_s = admit_wait_ms / 1e3
        # Set after each launch of the engine (a step listener), when admit_wait_s is used.
        self._launched = threading.Event()
        if self.admit_wait_s > 0 and loop.engine.kv_cache.is_cuda:
            loop.engine.runner.step_listeners.append(lambda _timing: self._launched.set())
        else:
            self.admit_wait_s = 0.0
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
        if slot.early_ring is not None:  # it came while the blocks were being reserved
            message, slot.early_ring = slot.early_ring, None
            self._ring_early(slot, message)
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
        if slot.early is not None:
            slot.writing = slot.early.drop()
        # Reserved and not pulled into, and (disjoint) delivered and not yet taken (unless
        # admitted: then the engine owns them, and the caller's abort frees them).
        blocks, slot.blocks = slot.blocks, []
        if slot.delivered.done() and slot.delivered.result().admitted is None:
            blocks += slot.delivered.result().block_ids or []
        if blocks:
            self._free(blocks, slot.writing)

    def _free(self, blocks: list[int], writing: torch.cuda.Event | None = None) -> None:
        """Back to the engine's pool; once `writing` (a dropped early copy into them) has
        completed, when one is given: a thread waits for it, and a copy that waits for a source
        that died mid-step keeps its blocks out of the pool (logged, with how many)."""
        if writing is None or writing.query():
            self.loop.call(lambda e: e.kv.free(blocks))
            return

        def wait() -> None:
            start = time.monotonic()
            warned = False
            while not writing.query():
                if not warned and time.monotonic() - start > STRANDED_WARN_S:
                    warned = True
                    log.warning("%d KV blocks wait for an early copy whose source has not "
                                "finished its step in %.0f s; they return to the pool when it "
                                "does", len(blocks), STRANDED_WARN_S)
                time.sleep(0.001 if time.monotonic() - start < 0.1 else 0.05)
            if warned:
                log.warning("%d KV blocks held by an early copy are free again", len(blocks))
            with contextlib.suppress(EngineLoopStopped):
                self.loop.call(lambda e: e.kv.free(blocks))

        threading.Thread(target=wait, name="kv-free-after", daemon=True).start()

    # ---- the doorbell ------------------------------------------------------------------------
    def ring(self, message: dict) -> None:
        """A doorbell's datagram (on the event loop's thread): start the pull now if the
        request's blocks are reserved and nobody pulls them yet; else leave it to Deliver.
        An early ring (a GPU on this host, sent when the prompt's last step was launched)
        starts the copy behind that step instead (_ring_early)."""
        heard = time.time()
        rid = message.get("request_id")
        slot = self.slots.get(rid) if isinstance(rid, str) else None
        if message.get("early"):
            if slot is None and isinstance(rid, str) and rid and rid not in self.gone:
                slot = self._early_slot(rid)
            if slot is not None:
                slot.marks["early ring heard"] = heard
                if not slot.reserved.done():  # taken up once the Decode call reserved
                    slot.early_ring = message
                    return
            self._ring_early(slot, message)
            return
        if (slot is None or slot.claimed or not slot.reserved.done()
                or slot.reserved.cancelled() or slot.delivered.done() or slot.ended):
            return
        try:
            desc = self._ring_descriptor(slot, message)
            if desc is None:  # a short ring without the early ring's descriptor: Deliver's
                return
            first_token_id = int(message["first_token_id"])
            remaining = float(message["deadline_unix_s"]) - time.time()
            first_token_unix_s = float(message.get("first_token_unix_s", 0.0))
        except (KeyError, TypeError, ValueError) as e:
            log.warning("request %s: a doorbell ring without a usable descriptor: %s", rid, e)
            return
        if remaining <= DEADLINE_MARGIN_S or desc.request_id != rid:
            return
        with contextlib.suppress(TypeError, ValueError):
            slot.marks["output at prefill sink"] = float(message.get("output_unix_s", 0.0))
            slot.marks["ring sent"] = float(message.get("sent_unix_s", 0.0))
        slot.marks["heard"] = heard
        pulled = _PullAttributes()  # the Deliver call's span gets them (deliver())
        aio = asyncio.get_running_loop()
        done = self._deliver_now(rid, desc, first_token_id, remaining, pulled,
                                 first_token_unix_s)
        if done is not None:  # delivered here and now (an early copy was queued)
            task = aio.create_future()
            task.set_result(done)
        else:
            slot.claimed = True
            task = aio.create_task(self._deliver(
                rid, desc, first_token_id, remaining, pulled, first_token_unix_s))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read by Deliver
        self.rung[rid] = (task, pulled)
        self.metrics.handoffs_rung.inc()
        # Forgotten if its Deliver call never comes (the prefill died after ringing).
        asyncio.get_running_loop().call_later(
            max(remaining, self.wait_s) + 1.0,
            lambda: self.rung.pop(rid, None) if self.rung.get(rid, (None,))[0] is task
            else None)

    @staticmethod
    def _ring_descriptor(slot: _Slot, message: dict) -> HandoffDescriptor | None:
        """A ring's descriptor: its own, or for a short ring (at the first token, after an
        early ring) the early ring's with the checksum and block hashes it lacked; None when
        the early ring's is not here."""
        if "descriptor_json" in message:
            return HandoffDescriptor.from_json(message["descriptor_json"])
        if slot.early is None:
            return None
        return slot.early.desc.completed(message["checksum"], message["block_hashes"])

    def _early_slot(self, request_id: str) -> _Slot:
        """The slot of a request whose early ring came before its Decode call (both leave
        the gateway at once; the ring wins when the prompt is launched at once): the call takes
        it up, or it is forgotten after wait_s."""
        slot = self._slot(request_id)

        def forget() -> None:
            if (self.slots.get(request_id) is slot and not slot.reserved.done()
                    and not slot.claimed):
                del self.slots[request_id]

        asyncio.get_running_loop().call_later(self.wait_s, forget)
        return slot

    def _ring_early(self, slot: _Slot | None, message: dict) -> None:
        """The prefill launched the step that writes the prompt's last KV, behind which it
        recorded the interprocess event named here: a thread prepares the copy with its sums into
        the reserved blocks and queues it behind that event, without a turn of the event loop.
        By default (early_copy_on_device) it is queued at once on a stream of its own that waits
        for the event on the device, so no host thread's wake-up lies between the prefill's
        step and the copy; a source that dies before its step ends may leave that stream
        waiting for good, so the stream is never shared (WaitingStreams) and the blocks stay
        out of the pool until the copy completes (_Early.drop, _free). Otherwise the thread
        waits for the event on the host and then queues the copy. The ring with the checksum
        (or the Deliver call) then only compares the sums. Ignored unless the blocks are
        reserved, nobody pulls yet, and the pool is a GPU's at TP 1."""
        pool = self.loop.engine.kv_cache
        if (slot is None or slot.claimed or slot.early is not None or not slot.reserved.done()
                or slot.reserved.cancelled() or slot.delivered.done() or slot.ended
                or not pool.is_cuda or self.shards is not None):
            return
        try:
            desc = HandoffDescriptor.from_json(message["descriptor_json"])
            offer = desc.transports["cuda_ipc"]
            handle = base64.b64decode(message["event"])
        except (KeyError, TypeError, ValueError) as e:
            log.warning("request %s: an early ring without a usable event: %s",
                        slot.request_id, e)
            return
        aio = asyncio.get_running_loop()
        early = slot.early = _Early(desc, aio.create_future())
        transport = self.receiver.transport("cuda_ipc")
        blocks, after = slot.reserved.result()

        def on_device() -> None:  # queued at once; the stream waits for the event
            event = transport.open_event(offer, handle)
            stream = waiting_streams.take(pool.device)
            copy = None
            try:
                with torch.cuda.stream(stream):
                    if after is not None:
                        stream.wait_event(after)
                    launch = transport.prepare_copy(offer, early.block_ids, pool, blocks, event)
                with early.lock:
                    if early.dropped or slot.ended:
                        raise TransferError("the early copy was dropped")
                    early.marks["early copy launching"] = time.time()
                    with torch.cuda.stream(stream):
                        copy = launch(early.marks)
                    early.marks["early copy queued"] = time.time()
                    early.copy = copy  # last: the loop's thread reads it unlocked
            finally:  # the stream is free again once its last work completes
                if copy is None:
                    stream.record_event(done := torch.cuda.Event())
                else:
                    done = copy[1]
                waiting_streams.give(stream, done)

        def on_host() -> None:  # queued once this thread has seen the event complete
            with transfer_stream(pool, after):
                launch = transport.prepare_copy(offer, early.block_ids, pool, blocks)
            transport.open_event(offer, handle).synchronize()
            early.marks["early event seen"] = time.time()
            with early.lock:
                if early.dropped or slot.ended:
                    raise TransferError("the early copy was dropped")
                early.marks["early copy launching"] = time.time()
                with transfer_stream(pool):
                    copy = launch(early.marks)
                early.marks["early copy queued"] = time.time()
                early.copy = copy  # last: the loop's thread reads it unlocked

        def wait() -> None:
            try:
                (on_device if self.early_copy_on_device else on_host)()
                then = (_resolve, early.queued, early.copy)
            except Exception as e:  # reported on the loop; the delivery pulls as usual
                early.failed = True
                then = (_settle, early.queued, e)
            with contextlib.suppress(RuntimeError):  # the loop closed: the service stops
                aio.call_soon_threadsafe(*then)

        threading.Thread(target=wait, name="kv-early", daemon=True).start()

    def _take_early(self, slot: _Slot, desc: HandoffDescriptor, blocks: list[int],
                    deadline: float | None, span: tracing.Span | _PullAttributes) -> str | None:
        """The pull of a delivery whose early copy is queued: wait for the copy (queued when
        the prefill's step ended, so done or nearly) and compare its sums with the checksum;
        "" when the KV may be used, else why not. None: no usable early copy (dropped; the
        caller pulls as usual)."""
        early = slot.early
        if early is None:
            return None
        if not early.matches(desc) or early.copy is None:
            slot.writing = early.drop()
            slot.early = None
            if slot.writing is not None:  # not pulled into: a copy from elsewhere may land
                return (f"handoff {desc.request_id}: an early copy from another source still "
                        "writes the reserved blocks")
            return None
        start = time.monotonic()
        slot.marks["early copy checked"] = time.time()
        pool = self.loop.engine.kv_cache
        host, done = early.copy
        slot.early = None
        try:
            check_geometry(desc, pool, blocks)
            done.synchronize()
            slot.marks["early copy done"] = time.time()
            got = combine(host.tolist())
            if got != desc.checksum:
                raise TransferError(f"handoff {desc.request_id}: checksum mismatch over "
                                    f"{len(blocks)} blocks via the early cuda_ipc copy (source "
                                    f"{desc.checksum}, received {got})")
        except TransferError as e:
            self.metrics.handoff_failures("transfer").inc()
            return str(e)
        return self._pulled(desc, "cuda_ipc", start, deadline, span, early=True)

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
        slot, blocks, after = await self._claim(request_id, first_token_id)
        deadline = None if time_remaining_s is None else arrived + time_remaining_s
        here = slot.early is not None or (self.loop.engine.kv_cache.is_cuda
                                          and desc.source_host_id == self.receiver.host)
        if here and (slot.early is None or slot.early.through):
            return self._pull_and_hand_over(slot, desc, first_token_id, blocks, after, arrived,
                                            deadline, span, first_token_unix_s)
        slot.pulling = True  # the blocks stay this call's while it waits
        try:
            if here:
                # The prefill's step has ended (its checksum is here), so the early copy is
                # about to be queued; waited for a little, then pulled as usual.
                await asyncio.wait((slot.early.queued,), timeout=EARLY_WAIT_S)
                reason = self._pull_here(slot, desc, blocks, after, deadline, span)
            else:
                reason = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._pull, desc, blocks, after, deadline, span)
        finally:
            slot.pulling = False
            slot.blocks = []  # from here on this call hands them on or frees them
        return self._hand_over(slot, blocks, first_token_id, reason, arrived,
                               first_token_unix_s)

    def _deliver_now(self, request_id: str, desc: HandoffDescriptor, first_token_id: int,
                     time_remaining_s: float, span: _PullAttributes,
                     first_token_unix_s: float) -> tuple[bool, str] | None:
        """_deliver without a turn of the event loop, for a ring whose early copy is queued
        already (then nothing in it waits: the ring's usual case on a GPU); None when it would
        wait, and nothing was done."""
        slot = self.slots.get(request_id)
        if (request_id in self.gone or slot is None or not slot.reserved.done()
                or slot.reserved.cancelled() or slot.delivered.done() or slot.ended
                or slot.early is None or slot.early.copy is None):
            return None
        arrived = time.monotonic()
        slot.claimed = True
        blocks, after = slot.reserved.result()
        return self._pull_and_hand_over(slot, desc, first_token_id, blocks, after, arrived,
                                        arrived + time_remaining_s, span, first_token_unix_s)

    def _pull_and_hand_over(self, slot: _Slot, desc: HandoffDescriptor, first_token_id: int,
                            blocks: list[int], after: torch.cuda.Event | None, arrived: float,
                            deadline: float | None, span: tracing.Span | _PullAttributes,
                            first_token_unix_s: float) -> tuple[bool, str]:
        """A delivery pulled on the event loop's thread (_pull_here), then handed over."""
        slot.pulling = True
        try:
            reason = self._pull_here(slot, desc, blocks, after, deadline, span)
        finally:
            slot.pulling = False
            slot.blocks = []  # from here on this call hands them on or frees them
        return self._hand_over(slot, blocks, first_token_id, reason, arrived,
                               first_token_unix_s)

    async def _claim(self, request_id: str, first_token_id: int,
                     ) -> tuple[_Slot, list[int], torch.cuda.Event | None]:
        """A delivery's slot, claimed, with its reserved blocks once they are (waiting up to
        wait_s for its Decode call); HandoffNotFoundError when nobody waits for the KV."""
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
        return slot, blocks, after

    def _pull_here(self, slot: _Slot, desc: HandoffDescriptor, blocks: list[int],
                   after: torch.cuda.Event | None, deadline: float | None,
                   span: tracing.Span | _PullAttributes) -> str:
        """The pull on the event loop's thread, for a GPU pool on the source's host: the early
        copy's sums compared, else the copy and its checksum kernel (~0.5 ms: the hop to the
        pull thread and back cost more, waiting for the GIL); "" or why the KV is refused."""
        early = slot.early
        if early is not None and early.copy is not None:
            slot.marks.update(early.marks)
        reason = self._take_early(slot, desc, blocks, deadline, span)
        return self._pull(desc, blocks, after, deadline, span) if reason is None else reason

    def _hand_over(self, slot: _Slot, blocks: list[int], first_token_id: int, reason: str,
                   arrived: float, first_token_unix_s: float) -> tuple[bool, str]:
        """After the pull: the KV to the Decode call (admitted to the engine at once when it
        asked), or the blocks freed and the prompt left to recompute."""
        request_id = slot.request_id
        handoff_ms = 1e3 * (time.monotonic() - arrived)
        if slot.ended:  # the Decode call left during the pull
            self._free(blocks, slot.writing)
            return False, f"request {request_id!r} ended during the pull"
        if reason:
            self._free(blocks, slot.writing)
            log.warning("request %s: %s; recomputing its prompt here", request_id, reason)
            slot.delivered.set_result(Taken(None, first_token_id, 0.0, handoff_ms, reason))
            return False, reason
        slot.marks["verified"] = time.time()
        taken = Taken(blocks, first_token_id, slot.reserve_ms, handoff_ms,
                      first_token_unix_s=first_token_unix_s, marks=slot.marks)
        if slot.admit is not None:
            # An idle engine launches the request's first step at once: its launch is token
            # 2's critical path, so this thread leaves it the GIL until then (admit_wait_s).
            wait = self.admit_wait_s > 0 and not self.loop.engine.num_running
            self._launched.clear()
            taken.admitted_unix_s = slot.marks["admitted"] = time.time()
            taken.admitted = slot.admit(taken)
            if wait and self._launched.wait(self.admit_wait_s):
                slot.marks["first step launched"] = time.time()
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
        return self._pulled(desc, name, start, deadline, span)

    def _pulled(self, desc: HandoffDescriptor, name: str, start: float, deadline: float | None,
                span: tracing.Span | _PullAttributes, early: bool = False) -> str:
        """A pull verified at this moment: "" if it ended in time (then counted), else why
        not."""
        done = time.monotonic()
        if deadline is not None and done > deadline - DEADLINE_MARGIN_S:
            self.metrics.handoff_failures("lease_expired").inc()
            return (f"handoff {desc.request_id}: the pull ended {1e3 * (done - deadline):+.1f} ms "
                    f"from the delivery's deadline; the source may have reused its blocks")
        self.transports_used[name] = self.transports_used.get(name, 0) + 1
        pool = self.loop.engine.kv_cache
        nbytes = handoff_bytes(desc, pool)
        self.metrics.observe_handoff(name, nbytes, done - start)
        span.set_attributes({"splitserve.transport": name, "splitserve.blocks": len(desc.block_ids),
                             "splitserve.bytes": nbytes, "splitserve.early": early,
                             "splitserve.gb_per_s": nbytes / 1e9 / max(done - start, 1e-9)})
        return ""

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.receiver.close()
