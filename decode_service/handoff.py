"""Taking over a handoff: claim the record, reserve blocks, pull the KV, confirm.

Block ownership: the blocks reserved here belong to the caller of pull() once it returns (it
hands them to the engine with Prefilled); on any failure or cancellation they are freed here, but
only after the transfer thread stopped writing into them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import redis

from common.errors import TransferError
from common.kv_transport.select import KVReceiver
from common.registry import Registry
from common.serving.engine_loop import EngineLoop
from common.serving.metrics import DecodeMetrics
from common.serving.tls import PLAINTEXT, TlsConfig

log = logging.getLogger("splitserve.decode.handoff")


class HandoffFailed(Exception):
    """The handoff's KV cannot be used (record gone or claimed elsewhere, transfer or checksum
    failure, lease expired during the pull); the prompt must be recomputed here."""


class HandoffPuller:
    def __init__(self, registry: Registry, loop: EngineLoop, instance_id: str,
                 timeout_s: float, metrics: DecodeMetrics, lease_renew_s: float = 10.0,
                 tls: TlsConfig = PLAINTEXT):
        """tls: this service's TlsConfig; grpc pulls dial prefill services with it."""
        self.registry = registry
        self.lease_renew_s = lease_renew_s
        self.loop = loop
        self.instance_id = instance_id
        self.receiver = KVReceiver(timeout_s=timeout_s, tls=tls)
        # Transports keep per-source state and are used by one thread at a time.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        self.pending: set[str] = set()
        self.transports_used: dict[str, int] = {}
        self.metrics = metrics

    async def pull(self, handoff_id: str) -> list[int]:
        """Blocks of this engine's pool now holding the handoff's prompt KV (caller owns them).

        One job on the pull thread claims, reserves (waiting on the engine thread directly),
        copies, verifies and confirms: one hop from the event loop and back, not one per step."""
        self.pending.add(handoff_id)
        job = asyncio.get_running_loop().run_in_executor(self._executor, self._take, handoff_id)
        renewal = asyncio.get_running_loop().create_task(self._renew(handoff_id))
        keep = False
        try:
            taken = await asyncio.shield(job)
            keep = True
            return taken
        finally:
            renewal.cancel()
            self.pending.discard(handoff_id)
            if not keep:  # cancelled: free what the job reserved once it is done with it
                self._free_when_done(job)

    def _free_when_done(self, future: asyncio.Future | Future,
                        blocks_of: Callable[[Any], list[int]] = lambda result: result) -> None:
        """Free the blocks a given-up future yields, if it yields any, once it completes."""
        def done(f: asyncio.Future | Future) -> None:
            if not f.cancelled() and f.exception() is None:
                blocks = blocks_of(f.result())
                self.loop.call(lambda e: e.free_blocks(blocks))

        future.add_done_callback(done)

    def _take(self, handoff_id: str) -> list[int]:
        """The pull thread's part of pull(): the reserved blocks, or HandoffFailed with every
        block it reserved freed."""
        start = time.monotonic()
        try:
            desc = self.registry.claim_handoff(handoff_id, self.instance_id)
        except redis.RedisError as e:
            self.metrics.handoff_failures("registry").inc()
            raise HandoffFailed(f"handoff {handoff_id}: registry unreachable ({e})") from e
        if desc is None:
            self.metrics.handoff_failures("gone").inc()
            raise HandoffFailed(f"handoff {handoff_id} is gone or claimed by another service")
        claimed = time.monotonic()
        n = len(desc.block_ids)
        reserved = self.loop.call(lambda e: e.reserve_blocks_for_copy(n))
        try:
            blocks, after = reserved.result(timeout=self.receiver.timeout_s)
        except FutureTimeout:
            self._free_when_done(reserved, blocks_of=lambda result: result[0])
            self.metrics.handoff_failures("transfer").inc()
            raise HandoffFailed(f"handoff {handoff_id}: the engine did not reserve {n} blocks "
                                f"within {self.receiver.timeout_s} s") from None
        got = time.monotonic()
        pool = self.loop.engine.kv_cache
        try:
            try:
                name = self.receiver.pull(desc, pool, blocks, after)
            except TransferError as e:
                self.metrics.handoff_failures("transfer").inc()
                raise HandoffFailed(str(e)) from e
            pulled = time.monotonic()
            if not self._complete(handoff_id):
                self.metrics.handoff_failures("lease_expired").inc()
                raise HandoffFailed(f"handoff {handoff_id}: the lease ran out during the pull")
        except BaseException:
            self.loop.call(lambda e: e.free_blocks(blocks))
            raise
        done = time.monotonic()
        self.transports_used[name] = self.transports_used.get(name, 0) + 1
        block_bytes = pool.numel() // pool.shape[2] * pool.element_size()
        self.metrics.observe_handoff(name, len(blocks) * block_bytes, done - start)
        log.debug("handoff %s via %s: claim %.2f ms, reserve %.2f ms, pull+verify %.2f ms, "
                  "confirm %.2f ms", handoff_id, name, 1e3 * (claimed - start),
                  1e3 * (got - claimed), 1e3 * (pulled - got), 1e3 * (done - pulled))
        return blocks

    async def _renew(self, handoff_id: str) -> None:
        """Keep the handoff's lease alive while its KV is being pulled (until cancelled)."""
        while True:
            await asyncio.sleep(self.lease_renew_s / 3)
            try:
                if not await asyncio.to_thread(self.registry.renew_lease, handoff_id,
                                               self.lease_renew_s):
                    return  # gone already: the confirmation will say so
            except redis.RedisError as e:
                log.warning("renewing the lease of handoff %s failed: %s", handoff_id, e)

    def _complete(self, handoff_id: str) -> bool:
        """Confirm the pull; False when the lease ran out first or the registry cannot say (the
        pulled KV is then discarded: without a confirmation its blocks may be reused)."""
        try:
            return self.registry.complete_handoff(handoff_id, self.instance_id)
        except redis.RedisError as e:
            log.warning("confirming handoff %s failed: %s", handoff_id, e)
            return False

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.receiver.close()
