"""The shared registry on Redis: service discovery, prefix index (no torch)."""

from common.registry.embedded import EmbeddedRedis
from common.registry.heartbeat import Heartbeat
from common.registry.records import HandoffDescriptor, InstanceInfo, InstanceKind
from common.registry.registry import Registry

__all__ = ["Registry", "EmbeddedRedis", "HandoffDescriptor", "Heartbeat",
           "InstanceInfo", "InstanceKind"]
