"""HandoffHolds: a published handoff's blocks stay pinned while its record lives and return to the
pool once it is confirmed, expires or is withdrawn; release_all frees everything at shutdown
(real Redis, a real engine on its loop, handoffs published as the Prefill servicer does)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from common.engine.engine import LLMEngine
from common.kv_transport.source import KVSource
from common.registry import EmbeddedRedis, HandoffState, Registry
from common.registry.embedded import free_port
from common.serving.engine_loop import EngineLoop
from common.serving.metrics import SLO, PrefillMetrics, engine_stats
from prefill_service.holds import HandoffHolds
from tests.prefill_service.conftest import NUM_BLOCKS, on_engine, prompt, until

INTERVAL_S = 0.01
SOURCE = "prefill-0"


@pytest.fixture
def source(engine: LLMEngine) -> Iterator[KVSource]:
    source = KVSource(SOURCE, engine.kv_cache, engine.model_name)
    yield source
    source.close()


@pytest.fixture
def metrics(engine: LLMEngine, loop: EngineLoop) -> PrefillMetrics:
    return PrefillMetrics(engine.model_name, SLO(),
                          lambda: loop.call(engine_stats).result(timeout=5))


@pytest.fixture
def hand_off(prefill, source: KVSource, registry: Registry):
    """hand_off(rid, num_tokens, lease_s): prefill a prompt with its blocks held, publish its
    handoff (described and checksummed by KVSource, as the servicer does); its held block ids."""
    starts = iter(range(0, 10_000, 97))

    def run(rid: str, num_tokens: int = 40, lease_s: float = 10.0) -> list[int]:
        token_ids = prompt(next(starts), num_tokens)
        out = prefill(rid, token_ids)
        assert out.held_block_ids is not None
        desc = source.describe(rid, out.held_block_ids, num_tokens, out.block_hashes)
        registry.publish_handoff(desc, lease_s)
        return out.held_block_ids

    return run


def counter(metrics: PrefillMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(f"splitserve_{name}_total",
                                              {"model_name": metrics.model_name})
    assert value is not None
    return value


def released(holds: HandoffHolds) -> dict[str, int]:
    """holds.released without its zero entries."""
    return {state.value: n for state, n in holds.released.items() if n}


async def num_free(loop: EngineLoop) -> int:
    return await on_engine(loop, lambda e: e.block_manager.num_free_blocks)


async def num_free_is(loop: EngineLoop, n: int) -> bool:
    return await num_free(loop) == n


async def held(loop: EngineLoop) -> dict[str, list[int]]:
    return await on_engine(loop, lambda e: {rid: list(t) for rid, t in e.held.items()})


def record_polls(registry: Registry) -> list[list[str]]:
    """Record the request ids of every reap_handoffs call on this registry (which still runs)."""
    polls: list[list[str]] = []
    reap = registry.reap_handoffs

    def recorded(request_ids):
        polls.append(list(request_ids))
        return reap(request_ids)

    registry.reap_handoffs = recorded
    return polls


@contextlib.asynccontextmanager
async def reaping(holds: HandoffHolds) -> AsyncIterator[asyncio.Task]:
    """holds.run() as a background task, as server.py runs it; cancelled at exit."""
    task = asyncio.create_task(holds.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_confirmed_handoff_releases_its_blocks(registry, loop, metrics, hand_off):
    async def main() -> None:
        holds = HandoffHolds(registry, loop, INTERVAL_S, metrics)
        async with reaping(holds) as task:
            blocks = hand_off("r1")  # 40 tokens: 3 blocks of 16
            assert len(blocks) == 3 and await num_free(loop) == NUM_BLOCKS - 3
            holds.add("r1")
            assert registry.claim_handoff("r1", "decode-0") is not None
            await asyncio.sleep(10 * INTERVAL_S)  # claimed, not confirmed: still pinned
            assert await held(loop) == {"r1": blocks} and holds.held == {"r1"}
            assert registry.complete_handoff("r1", "decode-0") is True
            await until(lambda: num_free_is(loop, NUM_BLOCKS))
            assert not task.done()
        assert holds.held == set() and await held(loop) == {}
        assert released(holds) == {"done": 1}
        assert registry.namespace_keys() == []  # the record and its done marker are gone
        assert counter(metrics, "handoff_leases_expired") == 0
        assert counter(metrics, "handoff_stranded_blocks") == 0

    asyncio.run(main())


def test_expired_lease_releases_the_blocks_and_counts_them_stranded(registry, loop, metrics,
                                                                    hand_off):
    lease_s = 0.3

    async def main() -> None:
        holds = HandoffHolds(registry, loop, INTERVAL_S, metrics)
        async with reaping(holds):
            published = time.monotonic()
            blocks = hand_off("r1", num_tokens=50, lease_s=lease_s)  # 4 blocks, nobody pulls
            holds.add("r1")
            await until(lambda: num_free_is(loop, NUM_BLOCKS))
            assert time.monotonic() - published >= lease_s  # not one moment before the lease
            # The counters are bumped by a callback of the release on the engine's thread.
            await until(lambda: counter(metrics, "handoff_leases_expired") == 1)
        assert len(blocks) == 4 and await held(loop) == {} and holds.held == set()
        assert released(holds) == {"expired": 1}
        assert counter(metrics, "handoff_stranded_blocks") == 4
        assert registry.reap_handoffs(["r1"]) == {"r1": HandoffState.EXPIRED}
        assert registry.namespace_keys() == []

    asyncio.run(main())


def test_one_poll_settles_each_handoff_on_its_own(registry, loop, metrics, hand_off):
    """Three handoffs at once: one confirmed, one expired, one still pending. Only the first two
    are released, each counted under its own state; the pending one keeps its blocks."""

    async def main() -> None:
        holds = HandoffHolds(registry, loop, INTERVAL_S, metrics)
        done = hand_off("done", num_tokens=40)          # 3 blocks
        expired = hand_off("expired", num_tokens=20, lease_s=0.2)  # 2 blocks
        pending = hand_off("pending", num_tokens=60)    # 4 blocks
        for rid in ("done", "expired", "pending"):
            holds.add(rid)
        assert await num_free(loop) == NUM_BLOCKS - 9
        assert registry.claim_handoff("done", "decode-0") is not None
        assert registry.complete_handoff("done", "decode-0") is True
        async with reaping(holds):
            await until(lambda: num_free_is(loop, NUM_BLOCKS - 4))
            await until(lambda: counter(metrics, "handoff_leases_expired") == 1)
        assert len(done) == 3 and len(expired) == 2
        assert await held(loop) == {"pending": pending} and holds.held == {"pending"}
        assert released(holds) == {"done": 1, "expired": 1}
        assert counter(metrics, "handoff_stranded_blocks") == 2  # the expired one's only
        assert registry.handoff_states(["done", "expired", "pending"]) == {
            "done": HandoffState.EXPIRED,  # its done marker was reaped with the poll
            "expired": HandoffState.EXPIRED, "pending": HandoffState.PENDING}
        await holds.release_all()

    asyncio.run(main())


def test_reaper_polls_only_while_something_is_held(registry, loop, metrics, hand_off):
    polls = record_polls(registry)

    async def main() -> None:
        holds = HandoffHolds(registry, loop, INTERVAL_S, metrics)
        async with reaping(holds) as task:
            await asyncio.sleep(20 * INTERVAL_S)
            assert polls == []  # asleep on its event, not polling
            hand_off("r1")
            holds.add("r1")
            await until(lambda: len(polls) >= 3)  # woken: one round trip for r1 each interval
            assert registry.cancel_handoff("r1") is True  # the record is gone: released
            await until(lambda: num_free_is(loop, NUM_BLOCKS))
            await asyncio.sleep(2 * INTERVAL_S)  # let a poll after the release start, if any
            settled = len(polls)
            await asyncio.sleep(20 * INTERVAL_S)
            assert len(polls) == settled and not task.done()  # asleep again
        assert set(map(tuple, polls)) == {("r1",)}
        assert released(holds) == {"expired": 1}  # a withdrawn record reads as expired

    asyncio.run(main())


def test_cancel_withdraws_the_record_then_frees_the_blocks(registry, loop, metrics, hand_off):
    async def main() -> None:
        holds = HandoffHolds(registry, loop, INTERVAL_S, metrics)
        hand_off("r1")
        holds.add("r1")
        assert registry.handoff_exists("r1")
        assert await holds.cancel("r1") is True
        assert not registry.handoff_exists("r1")
        assert registry.reap_handoffs(["r1"]) == {"r1": HandoffState.EXPIRED}
        assert holds.held == set() and await held(loop) == {}
        assert await num_free(loop) == NUM_BLOCKS
        # A decode service that claimed nothing yet finds nothing to claim or confirm.
        assert registry.claim_handoff("r1", "decode-0") is None
        assert registry.complete_handoff("r1") is False
        assert await holds.cancel("r1") is False  # nothing left to withdraw
        assert await holds.cancel("never-seen") is False
        assert released(holds) == {}  # withdrawals are not reaps
        assert counter(metrics, "handoff_leases_expired") == 0
        assert registry.namespace_keys() == []

    asyncio.run(main())


def test_cancel_after_confirmation_deletes_the_done_marker(registry, loop, metrics, hand_off):
    """The decode side confirmed before any poll saw it: cancel leaves no marker behind."""

    async def main() -> None:
        holds = HandoffHolds(registry, loop, INTERVAL_S, metrics)
        hand_off("r1")
        holds.add("r1")
        assert registry.complete_handoff("r1") is True
        assert registry.namespace_keys() == [registry.keys.done("r1")]
        assert await holds.cancel("r1") is True
        assert registry.namespace_keys() == []
        assert holds.held == set() and await num_free(loop) == NUM_BLOCKS

    asyncio.run(main())


def test_cancel_releases_the_blocks_even_with_the_registry_unreachable(
        registry, loop, metrics, hand_off, caplog):
    async def main() -> None:
        with Registry(f"redis://127.0.0.1:{free_port()}/0", "nowhere", timeout_s=0.2,
                      retries=0) as unreachable:
            holds = HandoffHolds(unreachable, loop, INTERVAL_S, metrics)
            hand_off("r1")  # published on the real registry
            holds.add("r1")
            with caplog.at_level(logging.WARNING, logger="splitserve.prefill.holds"):
                assert await holds.cancel("r1") is True
        assert "registry unreachable" in caplog.text
        assert holds.held == set() and await num_free(loop) == NUM_BLOCKS
        # The record was left behind: it expires with its lease, or is cleared at shutdown.
        assert registry.handoff_exists("r1")
        registry.cancel_handoff("r1")

    asyncio.run(main())


def test_release_all_withdraws_every_handoff(registry, loop, metrics, hand_off):
    """At shutdown (the reaper already cancelled): pending, claimed and confirmed-but-unreaped
    handoffs all go, with their records and markers; a late confirmation is refused."""

    async def main() -> None:
        holds = HandoffHolds(registry, loop, INTERVAL_S, metrics)
        for rid, n in (("pending", 40), ("claimed", 50), ("confirmed", 20)):
            hand_off(rid, num_tokens=n)
            holds.add(rid)
        assert await num_free(loop) == NUM_BLOCKS - 9
        assert registry.claim_handoff("claimed", "decode-0") is not None
        assert registry.complete_handoff("confirmed") is True
        await holds.release_all()
        assert holds.held == set() and await held(loop) == {}
        assert await num_free(loop) == NUM_BLOCKS
        assert registry.namespace_keys() == []
        # The decode side still pulling "claimed" learns the source may reuse its blocks.
        assert registry.complete_handoff("claimed", "decode-0") is False
        assert released(holds) == {}

    asyncio.run(main())


def test_reaper_outlives_a_redis_restart(loop, metrics, prefill, source, caplog):
    """Polls fail while Redis is down (logged, the blocks stay held, the task goes on); the
    restarted Redis has lost the record, which reads as expired: the blocks are released."""

    async def main() -> None:
        server = EmbeddedRedis()
        try:
            reg = Registry(server.url, "restart", timeout_s=0.2, retries=0)
            polls = record_polls(reg)
            holds = HandoffHolds(reg, loop, INTERVAL_S, metrics)
            out = prefill("r1", prompt(0, 40))
            desc = source.describe("r1", out.held_block_ids, 40, out.block_hashes)
            reg.publish_handoff(desc, 10.0)
            holds.add("r1")
            async with reaping(holds) as task:
                await until(lambda: len(polls) > 0)
                server.kill()
                with caplog.at_level(logging.ERROR, logger="splitserve.prefill.holds"):
                    await until(lambda: "polling handoff records failed" in caplog.text)
                assert await held(loop) == {"r1": out.held_block_ids} and holds.held == {"r1"}
                assert not task.done()
                server.stop()
                server = EmbeddedRedis(port=server.port)
                await until(lambda: num_free_is(loop, NUM_BLOCKS))
                await until(lambda: counter(metrics, "handoff_leases_expired") == 1)
            assert released(holds) == {"expired": 1} and holds.held == set()
            assert counter(metrics, "handoff_stranded_blocks") == 3
            reg.close()
        finally:
            server.stop()

    asyncio.run(main())
