"""The shared registry on Redis: service discovery, KV handoff records, prefix index (no torch)."""

from common.registry.embedded import EmbeddedRedis
from common.registry.heartbeat import Heartbeat
from common.registry.records import HandoffDescriptor, HandoffState, InstanceInfo, InstanceKind
from common.registry.registry import Registry

__all__ = ["Registry", "EmbeddedRedis", "HandoffDescriptor", "HandoffState", "Heartbeat",
           "InstanceInfo", "InstanceKind"]
