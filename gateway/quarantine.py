"""Instances the gateway stops routing to for a while because one of its calls to them failed and
they did not answer a health check: a killed service stays in the registry until its record's TTL
runs out, and without this every request routed there in the meantime would fail once first.

Pure Python: a deadline per instance id, checked against a monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from common.registry import InstanceInfo


class Quarantine:
    def __init__(self, duration_s: float, clock: Callable[[], float] = time.monotonic):
        if duration_s < 0:
            raise ValueError(f"quarantine duration must be >= 0, got {duration_s}")
        self.duration_s = duration_s
        self._clock = clock
        self._until: dict[str, float] = {}
        self.total = 0  # instances put in quarantine since start (metrics)

    def add(self, instance_id: str) -> None:
        self._until[instance_id] = self._clock() + self.duration_s
        self.total += 1

    def contains(self, instance_id: str) -> bool:
        until = self._until.get(instance_id)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[instance_id]
            return False
        return True

    def filter(self, instances: Sequence[InstanceInfo]) -> list[InstanceInfo]:
        """The instances not in quarantine, in their order."""
        return [i for i in instances if not self.contains(i.instance_id)]

    @property
    def current(self) -> list[str]:
        return sorted(i for i in list(self._until) if self.contains(i))
