"""Keeps this instance's set in the registry's prefix index equal to its prefix cache.

Hashes of a finished prompt are added at once (so the gateway routes the next request with that
prefix here); evictions are found by diffing the engine's cached hashes every few seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from common.registry import Registry
from common.serving.engine_loop import EngineLoop


class PrefixSync:
    def __init__(self, registry: Registry, loop: EngineLoop, instance_id: str):
        self.registry = registry
        self.loop = loop
        self.instance_id = instance_id
        self.published: set[int] = set()
        self.republish = False  # set by the heartbeat thread after a re-registration

    async def add(self, block_hashes: Iterable[int]) -> None:
        new = [h for h in block_hashes if h not in self.published]
        if new:
            self.published.update(new)
            await asyncio.to_thread(self.registry.publish_prefix, self.instance_id, new, [])

    async def sync(self) -> None:
        cached = set(await asyncio.wrap_future(
            self.loop.call(lambda e: list(e.block_manager.cached))))
        if self.republish:
            self.republish = False
            self.published = set(cached)
            await asyncio.to_thread(self.registry.replace_prefix, self.instance_id, sorted(cached))
            # add() may have run while the replace was in flight, and its write may have landed
            # before the replace wiped the set: publish what it added once more (idempotent).
            late = self.published - cached
            if late:
                await asyncio.to_thread(self.registry.publish_prefix, self.instance_id,
                                        sorted(late), [])
            return
        added, removed = cached - self.published, self.published - cached
        if added or removed:
            self.published = cached
            await asyncio.to_thread(self.registry.publish_prefix, self.instance_id,
                                    sorted(added), sorted(removed))
