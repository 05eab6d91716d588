"""The gateway's view of the live instances (re-read from the registry every
discovery_interval_s) and one channel per instance address, reused by every request.

Channels stay open after their instance leaves the registry: a service that deregistered at
shutdown still finishes the streams it has, and one restarted at the same address is reconnected.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.grpc_util import insecure_channel
from common.registry import BlockRegistry, InstanceInfo
from protos.splitserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger("splitserve.gateway.instances")

KINDS = ("prefill", "decode")


class Instances:
    def __init__(self, registry: BlockRegistry, interval_s: float):
        self.registry = registry
        self.interval_s = interval_s
        self._lists: dict[str, list[InstanceInfo]] = {k: [] for k in KINDS}
        self._read_at = -float("inf")
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prefill: dict[str, prefill_pb2_grpc.PrefillStub] = {}
        self._decode: dict[str, decode_pb2_grpc.DecodeStub] = {}

    async def get(self, kind: str) -> list[InstanceInfo]:
        """Live instances of one kind; re-read now if the list is empty or stale."""
        if not self._lists[kind] or time.monotonic() - self._read_at > 2 * self.interval_s:
            await self.refresh()
        return self._lists[kind]

    async def refresh(self) -> None:
        lists = await asyncio.to_thread(
            lambda: {k: self.registry.list_instances(k) for k in KINDS})
        self._lists = lists
        self._read_at = time.monotonic()

    async def run(self) -> None:
        """Keep the lists fresh; runs until cancelled."""
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("reading the instance list from the registry failed")
            await asyncio.sleep(self.interval_s)

    def prefill_stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        if address not in self._prefill:
            self._prefill[address] = prefill_pb2_grpc.PrefillStub(self._channel(address))
        return self._prefill[address]

    def decode_stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        if address not in self._decode:
            self._decode[address] = decode_pb2_grpc.DecodeStub(self._channel(address))
        return self._decode[address]

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = insecure_channel(address)
        return self._channels[address]

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        self._prefill.clear()
        self._decode.clear()
        for channel in channels.values():
            await channel.close(grace=1.0)
