"""Service discovery: each instance is one Redis key with a TTL, refreshed by its heartbeat.

A dead instance simply stops refreshing; its key (and its prefix set) expire within the TTL, so
nothing grows and nothing needs a reaper.
"""

from __future__ import annotations

import redis

from common.registry.keys import KeySpace
from common.registry.records import INSTANCE_KINDS, InstanceInfo


def scan_keys(r: redis.Redis, pattern: str) -> list[str]:
    return list(r.scan_iter(match=pattern, count=1000))


class Discovery:
    def __init__(self, r: redis.Redis, keys: KeySpace):
        self._r = r
        self._keys = keys

    def register(self, instance: InstanceInfo, ttl_s: float) -> bool:
        """Write (or refresh) the instance's record for ttl_s seconds and extend its prefix set to
        the same TTL. True if the record was absent before: a first registration, or a
        re-registration after the record was lost (Redis restarted, or the instance was silent
        for longer than its TTL), in which case its prefix set is gone too."""
        ms = _ttl_ms(ttl_s)
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self._keys.instance(instance.instance_id), instance.to_json(), px=ms, get=True)
        pipe.pexpire(self._keys.prefix(instance.instance_id), ms)
        previous, _ = pipe.execute()
        return previous is None

    def deregister(self, instance_id: str) -> None:
        self._r.delete(self._keys.instance(instance_id), self._keys.prefix(instance_id))

    def list_instances(self, kind: str) -> list[InstanceInfo]:
        """Live instances of one kind ("prefill" | "decode"), sorted by instance_id."""
        if kind not in INSTANCE_KINDS:
            raise ValueError(f"kind must be one of {INSTANCE_KINDS}, got {kind!r}")
        keys = scan_keys(self._r, self._keys.pattern("instance"))
        if not keys:
            return []
        infos = [InstanceInfo.from_json(v) for v in self._r.mget(keys) if v is not None]
        return sorted((i for i in infos if i.kind == kind), key=lambda i: i.instance_id)

    def get_instance(self, instance_id: str) -> InstanceInfo | None:
        value = self._r.get(self._keys.instance(instance_id))
        return None if value is None else InstanceInfo.from_json(value)


def _ttl_ms(ttl_s: float) -> int:
    if ttl_s <= 0:
        raise ValueError(f"ttl must be positive, got {ttl_s}")
    return max(1, round(ttl_s * 1000))
