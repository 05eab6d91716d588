"""Blocks held for handoffs, released when their registry record is gone.

Lease rule (see common/registry/handoff.py): a finished prompt's blocks stay held while its
handoff record exists. The record goes away when the decode side confirms (DONE), when its lease
runs out (EXPIRED) or when the request is aborted here (the record is deleted first, then the
blocks released). One task polls the records of all held handoffs in one round trip every
reap_interval_s, and sleeps while nothing is held.
"""

from __future__ import annotations

import asyncio
import logging

import redis

from common.registry import HandoffState, Registry
from common.serving.engine_loop import EngineLoop
from common.serving.metrics import PrefillMetrics

log = logging.getLogger("splitserve.prefill.holds")


class HandoffHolds:
    def __init__(self, registry: Registry, loop: EngineLoop, interval_s: float,
                 metrics: PrefillMetrics):
        self.registry = registry
        self.loop = loop
        self.interval_s = interval_s
        self.held: set[str] = set()
        self.released: dict[HandoffState, int] = {s: 0 for s in HandoffState}
        self.metrics = metrics
        self._wake = asyncio.Event()

    def add(self, request_id: str) -> None:
        self.held.add(request_id)
        self._wake.set()

    async def cancel(self, request_id: str) -> bool:
        """Withdraw a handoff (request aborted): delete its record (or the done marker of one
        the decode side already confirmed), then release its blocks."""
        was_held = request_id in self.held
        self.held.discard(request_id)
        try:
            await asyncio.to_thread(self._withdraw, request_id)
        except redis.RedisError as e:
            # The blocks are released all the same: a record left behind expires with its
            # lease, and a decode side that pulls reused blocks fails the checksum.
            log.warning("withdrawing handoff %s: registry unreachable (%s)", request_id, e)
        released = await asyncio.wrap_future(self.loop.abort(request_id))
        return was_held or released

    def _withdraw(self, request_id: str) -> None:
        if not self.registry.reap_handoffs([request_id])[request_id].finished:
            self.registry.cancel_handoff(request_id)

    async def run(self) -> None:
        """Release the blocks of every handoff whose record is gone; runs until cancelled."""
        while True:
            if not self.held:
                self._wake.clear()
                await self._wake.wait()
            request_ids = sorted(self.held)
            try:
                states = await asyncio.to_thread(self.registry.reap_handoffs, request_ids)
            except Exception:
                log.exception("polling handoff records failed")
                states = {}
            for request_id, state in states.items():
                if state.finished and request_id in self.held:
                    self.held.discard(request_id)
                    self.released[state] += 1
                    released = self.loop.call(lambda e, rid=request_id: _release(e, rid))
                    if state is HandoffState.EXPIRED:  # nobody pulled: the blocks were stranded
                        released.add_done_callback(
                            lambda f: self.metrics.observe_lease_expired(f.result()))
            await asyncio.sleep(self.interval_s)

    async def release_all(self) -> None:
        """At shutdown: withdraw every handoff still held."""
        for request_id in sorted(self.held):
            await self.cancel(request_id)


def _release(engine, request_id: str) -> int:
    """Release a held handoff on the engine's thread; the number of blocks it held."""
    num_blocks = len(engine.held.get(request_id, ()))
    engine.release_held(request_id)
    return num_blocks
