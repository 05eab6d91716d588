"""HandoffInbox: blocks reserved when the Decode call arrives, filled by the delivery, in either
order; every failure, a cancellation and a vanished peer leave no block reserved (real Redis for
the peer's record, a real engine on its loop, the source pool in this process)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import types

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.errors import HandoffNotFoundError, PeerGoneError
from common.flags import build
from common.kv_transport.source import KVSource
from common.registry import EmbeddedRedis, HandoffDescriptor, InstanceInfo, Registry
from common.serving.doorbell import DoorbellListener
from common.serving.engine_loop import EngineLoop
from common.serving.metrics import SLO, DecodeMetrics, engine_stats
from decode_service.handoff import HandoffInbox, _Early
from prefill_service.delivery import Deliveries

MODEL = "dummy:tiny-llama"
PREFILL = "prefill-0"


@pytest.fixture(scope="module")
def registry():
    with EmbeddedRedis() as server, Registry(server.url, "inbox") as registry:
        registry.register(InstanceInfo(PREFILL, "prefill", "127.0.0.1:1", MODEL), ttl_s=600)
        yield registry


@pytest.fixture
def setup(registry):
    engine = LLMEngine(build(EngineConfig, model=MODEL, device="cpu", num_kv_blocks=64))
    loop = EngineLoop(engine).start()
    metrics = DecodeMetrics(engine.model_name, SLO(),
                            lambda: loop.call(engine_stats).result(timeout=5))
    inbox = HandoffInbox(registry, loop, timeout_s=5.0, metrics=metrics, wait_s=0.5,
                         peer_check_s=0.1)
    # The prefill side: a pool of the same geometry in this process ("local" transport).
    src = torch.randn(engine.kv_cache.shape, generator=torch.Generator().manual_seed(3))
    source = KVSource(PREFILL, src, MODEL)
    yield engine, loop, inbox, source, src
    inbox.close()
    loop.stop()
    source.close()
    assert engine.block_manager.num_used_blocks == 0


def describe(source, rid: str, blocks: list[int], **changes):
    desc = source.describe(rid, blocks, num_tokens=16 * len(blocks), block_hashes=[])
    return dataclasses.replace(desc, **changes)


def used(loop) -> int:
    return loop.call(lambda e: e.block_manager.num_used_blocks).result(timeout=5)


def free(loop, blocks) -> None:
    loop.call(lambda e: e.kv.free(blocks)).result(timeout=5)


@pytest.mark.parametrize("order", ["decode call first", "delivery first"])
def test_delivery_fills_the_reserved_blocks(setup, order):
    engine, loop, inbox, source, src = setup
    desc = describe(source, "ok", [7, 3, 9])

    async def scenario():
        calls = [lambda: inbox.take("ok", 3, PREFILL), lambda: inbox.deliver("ok", desc, 42, 10.0)]
        if order == "delivery first":
            calls.reverse()
        first = asyncio.create_task(calls[0]())
        await asyncio.sleep(0.05)
        assert not first.done()  # the Decode call waits for the KV, or the delivery for the call
        assert inbox.pending == ({"ok"} if order == "decode call first" else set())
        second = asyncio.create_task(calls[1]())
        done = [await first, await second]
        return done if order == "decode call first" else done[::-1]

    taken, (accepted, reason) = asyncio.run(scenario())
    assert (accepted, reason, taken.first_token_id, taken.failure) == (True, "", 42, "")
    assert len(taken.block_ids) == 3 and used(loop) == 3
    for s, d in zip([7, 3, 9], taken.block_ids, strict=True):
        assert torch.equal(engine.kv_cache[:, :, d], src[:, :, s])
    assert inbox.transports_used == {"local": 1} and not inbox.pending and not inbox.slots
    free(loop, taken.block_ids)


@pytest.mark.parametrize("case", ["checksum", "deadline"])
def test_unusable_delivery_frees_the_blocks_and_recomputes(setup, case):
    _, loop, inbox, source, _ = setup
    desc = describe(source, case, [1, 2], **({"checksum": 12345} if case == "checksum" else {}))
    remaining = 0.01 if case == "deadline" else 10.0  # a pull ending this close is discarded

    async def scenario():
        take = asyncio.create_task(inbox.take(case, 2, PREFILL))
        return await inbox.deliver(case, desc, 7, remaining), await take

    (accepted, reason), taken = asyncio.run(scenario())
    assert not accepted and reason == taken.failure
    assert ("checksum mismatch" if case == "checksum" else "deadline") in reason
    assert (taken.block_ids, taken.first_token_id) == (None, 7)
    assert used(loop) == 0 and not inbox.slots


def test_cancelled_decode_call_frees_its_reservation_and_refuses_the_delivery(setup):
    _, loop, inbox, source, _ = setup

    async def scenario():
        take = asyncio.create_task(inbox.take("gone", 4, PREFILL))
        await asyncio.sleep(0.05)
        assert inbox.pending == {"gone"}
        take.cancel()
        await asyncio.gather(take, return_exceptions=True)
        await asyncio.sleep(0.05)  # the free is a command on the engine thread
        assert used(loop) == 0
        with pytest.raises(HandoffNotFoundError):  # at once, not after wait_s
            await asyncio.wait_for(inbox.deliver("gone", describe(source, "gone", [1]), 1, 10.0),
                                   0.2)

    asyncio.run(scenario())
    assert not inbox.slots


def test_delivery_without_a_decode_call_is_refused_after_the_wait(setup):
    _, _, inbox, source, _ = setup
    with pytest.raises(HandoffNotFoundError, match="no Decode call waits"):
        asyncio.run(inbox.deliver("nobody", describe(source, "nobody", [1]), 1, 10.0))
    # Kept a while, no blocks reserved, so that a late Decode call recomputes (the next test).
    assert list(inbox.slots) == ["nobody"] and not inbox.pending


def test_vanished_prefill_frees_the_reservation(setup):
    _, loop, inbox, _, _ = setup
    with pytest.raises(PeerGoneError, match="prefill-9 left the registry"):
        asyncio.run(inbox.take("orphan", 5, "prefill-9"))
    assert used(loop) == 0 and not inbox.slots


def test_decode_call_cancelled_during_the_pull_frees_the_blocks_after_it(setup):
    """The pull thread is still writing when the call leaves: the blocks are freed only once it
    is done, and the delivery is refused (the prefill side then releases its own)."""
    _, loop, inbox, source, _ = setup
    receiver_pull = inbox.receiver.pull
    pulling = threading.Event()

    def slow_pull(*args, **kwargs):  # the real pull, after a pause in which the call leaves
        pulling.set()
        time.sleep(0.3)
        return receiver_pull(*args, **kwargs)

    inbox.receiver.pull = slow_pull

    async def scenario():
        take = asyncio.create_task(inbox.take("mid", 3, PREFILL))
        deliver = asyncio.create_task(inbox.deliver("mid", describe(source, "mid", [4, 5, 6]),
                                                    9, 10.0))
        await asyncio.to_thread(pulling.wait, 5)
        take.cancel()
        await asyncio.gather(take, return_exceptions=True)
        assert used(loop) == 3  # still being written: not freed under the pull's feet
        accepted, reason = await deliver
        await asyncio.sleep(0.05)
        return accepted, reason

    accepted, reason = asyncio.run(scenario())
    assert not accepted and "ended during the pull" in reason
    assert used(loop) == 0 and not inbox.slots


def test_a_decode_call_later_than_the_delivery_wait_recomputes(setup):
    """The delivery gives up after wait_s (the prefill side then releases its blocks); the
    Decode call that comes after it recomputes the prompt instead of waiting for a delivery."""
    _, loop, inbox, source, _ = setup

    async def scenario():
        with pytest.raises(HandoffNotFoundError):
            await inbox.deliver("late", describe(source, "late", [1, 2]), 3, 10.0)
        return await asyncio.wait_for(inbox.take("late", 2, PREFILL), 2)

    taken = asyncio.run(scenario())
    assert (taken.block_ids, taken.first_token_id) == (None, 3)
    assert "waited" in taken.failure and used(loop) == 0 and not inbox.slots


def ring_message(desc, first_token_id: int = 42, deadline_in_s: float = 10.0) -> dict:
    return {"request_id": desc.request_id, "first_token_id": first_token_id,
            "first_token_unix_s": time.time(), "deadline_unix_s": time.time() + deadline_in_s,
            "descriptor_json": desc.to_json()}


def test_a_doorbell_starts_the_pull_and_the_deliver_call_answers_with_its_outcome(setup):
    """The ring pulls into the reserved blocks before any Deliver call; the call that follows
    pulls nothing more and answers with the ring's outcome."""
    engine, loop, inbox, source, src = setup
    desc = describe(source, "rung", [7, 3, 9])

    async def scenario():
        take = asyncio.create_task(inbox.take("rung", 3, PREFILL))
        await asyncio.sleep(0.05)
        inbox.ring(ring_message(desc))
        inbox.ring(ring_message(desc))  # a second ring is ignored: one pull
        taken = await asyncio.wait_for(take, 5)  # no Deliver call yet
        assert inbox.transports_used == {"local": 1}
        return taken, await inbox.deliver("rung", desc, 42, 10.0)

    taken, answer = asyncio.run(scenario())
    assert answer == (True, "") and taken.failure == "" and taken.first_token_id == 42
    assert taken.first_token_unix_s > 0
    for s, d in zip([7, 3, 9], taken.block_ids, strict=True):
        assert torch.equal(engine.kv_cache[:, :, d], src[:, :, s])
    assert inbox.transports_used == {"local": 1} and not inbox.rung and not inbox.slots
    free(loop, taken.block_ids)


@pytest.mark.parametrize("case", ["before the reservation", "past its deadline", "malformed",
                                  "after the call began", "short, no early descriptor"])
def test_a_ring_the_inbox_cannot_act_on_is_left_to_the_deliver_call(setup, case):
    _, loop, inbox, source, _ = setup
    desc = describe(source, "late-ring", [1, 2])

    async def scenario():
        if case == "before the reservation":
            inbox.ring(ring_message(desc))
        take = asyncio.create_task(inbox.take("late-ring", 2, PREFILL))
        await asyncio.sleep(0.05)
        deliver = None
        if case == "past its deadline":
            inbox.ring(ring_message(desc, deadline_in_s=0.01))
        elif case == "malformed":
            inbox.ring({"request_id": "late-ring", "descriptor_json": "{"})
        elif case == "short, no early descriptor":  # the early ring never came (or was dropped)
            inbox.ring({"request_id": "late-ring", "first_token_id": 5,
                        "checksum": desc.checksum, "block_hashes": [],
                        "deadline_unix_s": time.time() + 10})
        elif case == "after the call began":
            deliver = asyncio.create_task(inbox.deliver("late-ring", desc, 5, 10.0))
            await asyncio.sleep(0)  # the call has claimed the slot
            inbox.ring(ring_message(desc))
        assert not inbox.rung
        answer = await (deliver or inbox.deliver("late-ring", desc, 5, 10.0))
        return answer, await take

    answer, taken = asyncio.run(scenario())
    assert answer == (True, "") and len(taken.block_ids) == 2
    assert inbox.transports_used == {"local": 1}
    free(loop, taken.block_ids)


def early_message(desc) -> dict:
    return {"request_id": desc.request_id, "early": True, "event": "AAAA",
            "descriptor_json": desc.to_json(), "deadline_unix_s": time.time() + 10}


def test_an_early_ring_before_the_decode_call_waits_for_it_or_is_forgotten(setup):
    """Both leave the gateway at once, and the early ring may win: its slot waits for the call,
    which takes it up (on a CPU pool the early copy then declines, and the delivery pulls as
    usual); a slot whose call never comes is forgotten after wait_s, reserving nothing."""
    _, loop, inbox, source, _ = setup
    desc = describe(source, "early-first", [4, 5])
    lonely = describe(source, "early-alone", [6])

    async def scenario():
        inbox.ring(early_message(desc))
        inbox.ring(early_message(lonely))
        assert {"early-first", "early-alone"} <= set(inbox.slots) and not inbox.pending
        take = asyncio.create_task(inbox.take("early-first", 2, PREFILL))
        await asyncio.sleep(0.05)
        assert inbox.slots["early-first"].early_ring is None  # taken up, then declined (CPU)
        inbox.ring(ring_message(desc))
        taken = await asyncio.wait_for(take, 5)
        await asyncio.sleep(inbox.wait_s + 0.1)
        return taken, await inbox.deliver("early-first", desc, 42, 10.0)

    taken, answer = asyncio.run(scenario())
    assert answer == (True, "") and taken.failure == "" and len(taken.block_ids) == 2
    assert "early ring heard" in taken.marks and "verified" in taken.marks
    assert not inbox.slots and used(loop) == 2
    free(loop, taken.block_ids)


def test_a_rung_pull_whose_decode_call_left_frees_the_blocks(setup):
    """The Decode call is cancelled while a ring's pull runs: the blocks are freed after it,
    and the Deliver call that comes is refused."""
    _, loop, inbox, source, _ = setup
    receiver_pull = inbox.receiver.pull
    pulling = threading.Event()

    def slow_pull(*args, **kwargs):
        pulling.set()
        time.sleep(0.3)
        return receiver_pull(*args, **kwargs)

    inbox.receiver.pull = slow_pull
    desc = describe(source, "rung-gone", [4, 5, 6])

    async def scenario():
        take = asyncio.create_task(inbox.take("rung-gone", 3, PREFILL))
        await asyncio.sleep(0.05)
        inbox.ring(ring_message(desc))
        await asyncio.to_thread(pulling.wait, 5)
        take.cancel()
        await asyncio.gather(take, return_exceptions=True)
        assert used(loop) == 3
        answer = await inbox.deliver("rung-gone", desc, 9, 10.0)
        await asyncio.sleep(0.05)
        return answer

    accepted, reason = asyncio.run(scenario())
    assert not accepted and "ended during the pull" in reason
    assert used(loop) == 0 and not inbox.slots and not inbox.rung


def test_a_verified_kv_is_admitted_at_once_and_its_blocks_are_the_admitters(setup):
    """take()'s admit runs when the KV is verified, before take() returns; from then on the
    blocks are the admitter's: a Decode call cancelled after it does not free them."""
    _, loop, inbox, source, _ = setup
    from concurrent.futures import Future
    admitted: list = []

    def admit(taken):
        admitted.append(taken)
        future = Future()
        future.set_result(None)
        return future

    async def scenario():
        take = asyncio.create_task(inbox.take("admit", 3, PREFILL, admit=admit))
        await asyncio.sleep(0.05)
        answer = await inbox.deliver("admit", describe(source, "admit", [1, 2, 3]), 4, 10.0)
        assert len(admitted) == 1 and not take.done()  # admitted before the call resumed
        take.cancel()  # the call leaves right after: the blocks stay with the admitter
        await asyncio.gather(take, return_exceptions=True)
        await asyncio.sleep(0.05)
        return answer

    assert asyncio.run(scenario()) == (True, "")
    (taken,) = admitted
    assert taken.admitted is not None and taken.admitted_unix_s > 0
    assert used(loop) == 3 and not inbox.slots
    free(loop, taken.block_ids)


def test_an_unusable_kv_is_not_admitted(setup):
    _, loop, inbox, source, _ = setup
    admitted: list = []

    async def scenario():
        take = asyncio.create_task(inbox.take("bad", 2, PREFILL, admit=admitted.append))
        answer = await inbox.deliver("bad", describe(source, "bad", [1, 2], checksum=5), 4, 10.0)
        return answer, await take

    (accepted, _), taken = asyncio.run(scenario())
    assert not accepted and taken.block_ids is None and taken.admitted is None and not admitted
    assert used(loop) == 0


def test_the_early_and_the_short_ring_make_the_whole_descriptor(setup):
    """The prefill's two rings of an early handoff, through a real doorbell: the early one's
    descriptor lacks the checksum and block hashes, the short one brings them, and together
    they give the decode side the descriptor a whole ring would have carried."""
    _, _, inbox, source, _ = setup
    address = f"127.0.0.1:{id(object())}"
    blocks, hashes = [3, 4], [11, -12]
    # A CPU source offers no cuda_ipc: one stands in for the pool's handle (never opened here).
    ipc = {**source.offers, "cuda_ipc": {"handle": "aGFuZGxl"}}
    full = dataclasses.replace(source.describe("two-rings", blocks, 32, hashes, checksum=1234),
                               transports=ipc)
    deliveries = Deliveries(None, 10.0, None)

    async def scenario():
        got: list[dict] = []
        arrived = asyncio.Event()

        def on_ring(message):
            got.append(message)
            if len(got) == 2:
                arrived.set()

        listener = DoorbellListener(address, on_ring).start()
        try:
            early = dataclasses.replace(source.describe("two-rings", blocks, 32, (), checksum=0),
                                        transports=ipc)
            assert deliveries.ring_early(early, b"\x01" * 64, address)
            assert deliveries.ring_checksum("two-rings", 42, 1234, hashes, address,
                                            time.time(), time.time())
            await asyncio.wait_for(arrived.wait(), 5)
        finally:
            deliveries.doorbell.close()
            listener.close()
        return got

    early_ring, short_ring = asyncio.run(scenario())
    assert early_ring["early"] and "descriptor_json" not in short_ring
    early = _Early(HandoffDescriptor.from_json(early_ring["descriptor_json"]), None)
    rebuilt = inbox._ring_descriptor(types.SimpleNamespace(early=early), short_ring)
    assert dataclasses.replace(rebuilt, created_at=0) == dataclasses.replace(full, created_at=0)
    assert early.matches(rebuilt) and short_ring["first_token_id"] == 42


def test_dropping_an_early_copy_stops_it_or_names_what_still_writes(setup):
    """_Early.drop against the thread that queues the copy (the lock between them): dropped
    before, the thread finds it dropped and queues nothing; dropped after, drop() waits for the
    copy to be queued and returns its event while it has not completed (it may wait on the
    device for a source that died): the slot's blocks are freed only after it (_free)."""
    _, _, _, source, _ = setup
    desc = describe(source, "drop-race", [1, 2])

    class Event:
        def __init__(self, completed: bool):
            self.completed = completed

        def query(self) -> bool:
            return self.completed

    async def scenario():
        aio = asyncio.get_running_loop()
        before = _Early(desc, aio.create_future())
        assert before.drop() is None
        with before.lock:  # what the thread checks before queueing
            assert before.dropped and before.copy is None
        assert before.queued.cancelled() and not before.through

        for completed in (False, True):
            after = _Early(desc, aio.create_future())
            started, release = threading.Event(), threading.Event()
            event = Event(completed)

            def thread(early=after, started=started, release=release, event=event) -> None:
                with early.lock:  # holds the lock while it queues, as _ring_early's does
                    started.set()
                    release.wait(5)
                    early.copy = (torch.zeros(2, 2, dtype=torch.int64), event)

            worker = threading.Thread(target=thread)
            worker.start()
            started.wait(5)
            threading.Timer(0.05, release.set).start()
            writing = after.drop()  # blocks until the copy is queued
            worker.join()
            assert after.dropped and after.through
            assert writing is (None if completed else event)

    asyncio.run(scenario())


def test_blocks_an_early_copy_still_writes_return_to_the_pool_after_it(setup):
    """_free with a dropped early copy's event that has not completed (its source may have died
    mid-step): the blocks stay out of the pool until the event completes, then return."""
    engine, loop, inbox, _, _ = setup

    class Event:
        completed = False

        def query(self) -> bool:
            return self.completed

    blocks = loop.call(lambda e: e.kv.reserve(3)).result(timeout=5)
    assert used(loop) == 3
    event = Event()
    inbox._free(blocks, event)
    time.sleep(0.2)
    assert used(loop) == 3  # still written
    event.completed = True
    deadline = time.monotonic() + 5
    while used(loop) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert used(loop) == 0
