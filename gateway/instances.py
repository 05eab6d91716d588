"""The gateway's view of the live instances (re-read from the registry every
discovery_interval_s) and one channel per instance address, reused by every request.

Channels stay open after their instance leaves the registry: a service that deregistered at
shutdown still finishes the streams it has, and one restarted at the same address is reconnected.
Instances in quarantine (gateway/quarantine.py) are left out of the lists; while the registry is
unreachable (Redis restarting), the last lists read stand: the services outlive the outage.
Every new read is handed to the `on_refresh` callbacks (the gateway's readiness), whoever asked
for it, so what a request saw and what the health check says never disagree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
import redis

from common.registry import InstanceInfo, Registry
from common.serving import grpc_util
from common.serving.tls import PLAINTEXT, TlsConfig
from gateway.quarantine import Quarantine
from protos.splitserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger("splitserve.gateway.instances")

KINDS = ("prefill", "decode")


class Instances:
    def __init__(self, registry: Registry, interval_s: float, tls: TlsConfig = PLAINTEXT,
                 quarantine: Quarantine | None = None):
        self.registry = registry
        self.interval_s = interval_s
        self.tls = tls
        self.quarantine = quarantine if quarantine is not None else Quarantine(0.0)
        self._lists: dict[str, list[InstanceInfo]] = {k: [] for k in KINDS}
        self._read_at = -float("inf")
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prefill: dict[str, prefill_pb2_grpc.PrefillServiceStub] = {}
        self._decode: dict[str, decode_pb2_grpc.DecodeServiceStub] = {}
        self.on_refresh: list[Callable[[], Awaitable[object]]] = []

    async def get(self, kind: str) -> list[InstanceInfo]:
        """Live instances of one kind, not in quarantine; re-read now if the list is empty or
        stale (if the registry does not answer, the last list read, unless it is empty)."""
        if not self._lists[kind] or time.monotonic() - self._read_at > 2 * self.interval_s:
            try:
                await self.refresh()
            except redis.RedisError:
                if not self._lists[kind]:
                    raise
        return self.usable(kind)

    def usable(self, kind: str) -> list[InstanceInfo]:
        """The last list read of one kind, less the instances in quarantine (no registry call)."""
        return self.quarantine.filter(self._lists[kind])

    async def refresh(self) -> None:
        lists = await asyncio.to_thread(
            lambda: {k: self.registry.list_instances(k) for k in KINDS})
        self._lists = lists
        self._read_at = time.monotonic()
        for callback in self.on_refresh:
            await callback()

    async def run(self) -> None:
        """Keep the lists fresh; runs until cancelled."""
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("reading the instance list from the registry failed")
            await asyncio.sleep(self.interval_s)

    def prefill_stub(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        if address not in self._prefill:
            self._prefill[address] = prefill_pb2_grpc.PrefillServiceStub(self._channel(address))
        return self._prefill[address]

    def decode_stub(self, address: str) -> decode_pb2_grpc.DecodeServiceStub:
        if address not in self._decode:
            self._decode[address] = decode_pb2_grpc.DecodeServiceStub(self._channel(address))
        return self._decode[address]

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc_util.channel(address, self.tls)
        return self._channels[address]

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        self._prefill.clear()
        self._decode.clear()
        for channel in channels.values():
            await channel.close(grace=1.0)
