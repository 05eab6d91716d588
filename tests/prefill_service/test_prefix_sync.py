"""PrefixSync: the instance's set in the registry's prefix index follows the engine's prefix cache:
a finished prompt's full blocks at once, evictions at the next sync, the whole set again after a
re-registration (real Redis, a real engine on its loop)."""

from __future__ import annotations

import asyncio

import pytest

from common.engine.core.block_manager import hash_prefix_blocks
from common.registry import Heartbeat, InstanceInfo, Registry
from common.serving.engine_loop import EngineLoop
from prefill_service.prefix_sync import PrefixSync
from tests.prefill_service.conftest import BLOCK_SIZE, MODEL, NUM_BLOCKS, on_engine, prompt

INSTANCE = "prefill-0"
INFO = InstanceInfo(instance_id=INSTANCE, kind="prefill", address="127.0.0.1:1", model=MODEL,
                    block_size=BLOCK_SIZE)
TTL_S = 30.0


@pytest.fixture
def registered(registry: Registry) -> Registry:
    """The registry with this instance registered (the prefix index refuses writes otherwise)."""
    assert registry.register(INFO, TTL_S) is True
    return registry


def index(registry: Registry) -> set[int]:
    """The instance's set in the prefix index, as ints."""
    return {int(h) for h in registry.redis.smembers(registry.keys.prefix(INSTANCE))}


async def cached(loop: EngineLoop) -> set[int]:
    return set(await on_engine(loop, lambda e: list(e.block_manager.cached)))


def prefix_writes(registry: Registry) -> int:
    """Lua script runs the server has answered (every prefix-index write is one)."""
    return int(registry.redis.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_add_publishes_the_prompts_full_blocks(registered, loop, prefill):
    token_ids = prompt(0, 40)  # 2 full blocks of 16, then 8 tokens that are never indexed
    want = hash_prefix_blocks(token_ids, BLOCK_SIZE)

    async def main() -> None:
        prefixes = PrefixSync(registered, loop, INSTANCE)
        out = prefill("r1", token_ids, hold=False)
        assert out.block_hashes == want and len(want) == 2
        await prefixes.add(out.block_hashes)
        assert index(registered) == set(want) == await cached(loop)
        assert prefixes.published == set(want)
        # The gateway's view: a longer prompt with the same start matches both blocks here.
        longer = hash_prefix_blocks(token_ids + prompt(300, 40), BLOCK_SIZE)
        assert registered.match_prefix([INSTANCE], longer) == {INSTANCE: 2}
        # Only hashes not yet published are sent: with the set wiped behind its back, adding
        # the same prompt again writes nothing (the next republish repairs such a loss).
        registered.redis.delete(registered.keys.prefix(INSTANCE))
        writes = prefix_writes(registered)
        await prefixes.add(out.block_hashes)
        assert prefix_writes(registered) == writes and index(registered) == set()

    asyncio.run(main())


def test_sync_publishes_new_blocks_and_drops_evicted_ones(registered, loop, prefill):
    """A fills 4 blocks; B needs 10 of the 12, so after the 8 never-used blocks it takes A's two
    last (a finished sequence frees tail first): those hashes leave the index at the next sync,
    A's first two stay."""
    a_ids, b_ids = prompt(0, 64), prompt(200, 160)
    a, b = hash_prefix_blocks(a_ids, BLOCK_SIZE), hash_prefix_blocks(b_ids, BLOCK_SIZE)

    async def main() -> None:
        prefixes = PrefixSync(registered, loop, INSTANCE)
        prefill("a", a_ids, hold=False)  # not add()ed: sync finds it by diffing the cache
        await prefixes.sync()
        assert index(registered) == set(a) and prefixes.published == set(a)
        prefill("b", b_ids, hold=False)
        assert await cached(loop) == set(a[:2] + b)  # the engine evicted a[2:]
        await prefixes.sync()
        assert index(registered) == set(a[:2] + b) == prefixes.published
        assert registered.match_prefix([INSTANCE], a) == {INSTANCE: 2}
        assert registered.match_prefix([INSTANCE], b) == {INSTANCE: 10}
        writes = prefix_writes(registered)
        await prefixes.sync()  # nothing changed: nothing written
        assert prefix_writes(registered) == writes

    assert len(a) == 4 and len(b) == 10 == NUM_BLOCKS - 2
    asyncio.run(main())


def test_sync_after_add_sends_only_evictions(registered, loop, prefill):
    """Hashes that add() published are not sent again by sync; a held prompt's blocks are
    cached (and indexed) while held, and stay indexed after release until reused."""
    token_ids = prompt(0, 48)  # 3 full blocks

    async def main() -> None:
        prefixes = PrefixSync(registered, loop, INSTANCE)
        out = prefill("held", token_ids)
        await prefixes.add(out.block_hashes)
        writes = prefix_writes(registered)
        await prefixes.sync()
        assert prefix_writes(registered) == writes
        assert index(registered) == set(out.block_hashes)
        assert await on_engine(loop, lambda e: e.kv.release("held")) is True
        await prefixes.sync()  # freed, not evicted: still cached, still indexed
        assert index(registered) == set(out.block_hashes) == await cached(loop)
        assert prefix_writes(registered) == writes

    asyncio.run(main())


def test_republish_after_reregistration_replaces_the_whole_set(registered, loop, prefill):
    """The instance record is lost (Redis restart, a stall past the TTL) and its prefix set
    with it; hashes added meanwhile are refused. The heartbeat re-registers and flags a
    republish (wired as server.py does); the next sync replaces the set with the engine's
    whole cache, dropping whatever else the set held."""
    a_ids, b_ids = prompt(0, 32), prompt(100, 48)

    async def main() -> None:
        prefixes = PrefixSync(registered, loop, INSTANCE)
        heartbeat = Heartbeat(registered, INFO, TTL_S,
                              on_reregister=lambda: setattr(prefixes, "republish", True))
        a = prefill("a", a_ids, hold=False).block_hashes
        await prefixes.add(a)
        assert index(registered) == set(a)

        registered.deregister(INSTANCE)  # the record and the set are gone
        b = prefill("b", b_ids, hold=False).block_hashes
        await prefixes.add(b)  # refused by the index: the instance is not registered
        assert index(registered) == set() and prefixes.published == set(a + b)
        heartbeat.beat()
        assert heartbeat.reregistrations == 1 and prefixes.republish is True

        stale = 12345  # something the set holds that the cache does not
        assert registered.publish_prefix(INSTANCE, [stale], []) is True
        await prefixes.sync()
        assert prefixes.republish is False
        assert index(registered) == set(a + b) == await cached(loop) == prefixes.published
        # The set lives and dies with the instance record again.
        ttl = registered.redis.pttl(registered.keys.prefix(INSTANCE))
        assert 0 < ttl <= TTL_S * 1000
        heartbeat.beat()  # an ordinary beat: no republish
        assert heartbeat.reregistrations == 1 and prefixes.republish is False

    assert len(a_ids) // BLOCK_SIZE == 2 and len(b_ids) // BLOCK_SIZE == 3
    asyncio.run(main())



def test_add_during_a_republish_is_not_lost(registered, loop, prefill, monkeypatch):
    """A prompt finishes while a republish's replace is in flight: its add() may write before the
    replace wipes the set, so the sync publishes what add() marked meanwhile once more."""
    import threading

    inside = threading.Event()
    proceed = threading.Event()
    real_replace = registered.replace_prefix

    def replace_and_wait_for_the_add(instance_id: str, hashes: list[int]) -> bool:
        inside.set()
        assert proceed.wait(10)
        return real_replace(instance_id, hashes)

    monkeypatch.setattr(registered, "replace_prefix", replace_and_wait_for_the_add)

    async def main() -> None:
        prefixes = PrefixSync(registered, loop, INSTANCE)
        prefill("a", prompt(0, 32), hold=False)
        prefixes.republish = True
        task = asyncio.create_task(prefixes.sync())
        assert await asyncio.to_thread(inside.wait, 10)  # sync snapshotted; replace not yet run
        b = prefill("b", prompt(100, 32), hold=False).block_hashes
        await prefixes.add(b)  # its write lands first ...
        proceed.set()          # ... then the replace of the older snapshot
        await task
        assert set(b) <= index(registered)
        assert index(registered) == await cached(loop) == prefixes.published

    asyncio.run(main())
