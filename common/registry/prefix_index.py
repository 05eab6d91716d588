"""Prefix index for cache-aware routing: which block hashes each instance holds in its prefix cache.

One Redis set per instance, holding its cached block hashes (decimal strings). The set carries the
instance's TTL: the Lua scripts copy the instance record's remaining TTL onto it, and every
heartbeat extends both, so the set disappears with the instance. An unregistered instance's writes
are refused (they would never expire).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from common.registry.keys import KeySpace

# KEYS: instance record, prefix set. ARGV: n_removed, removed..., added...
# Removals go first, so a hash both evicted and re-cached since the last publish stays.
_UPDATE = """
local ttl = redis.call('PTTL', KEYS[1])
if ttl <= 0 then return 0 end
local n_removed = tonumber(ARGV[1])
for i = 2, n_removed + 1, 5000 do
  redis.call('SREM', KEYS[2], unpack(ARGV, i, math.min(i + 4999, n_removed + 1)))
end
for i = n_removed + 2, #ARGV, 5000 do
  redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 4999, #ARGV)))
end
redis.call('PEXPIRE', KEYS[2], ttl)
return 1
"""

# KEYS: instance record, prefix set. ARGV: hashes... (the whole set)
_REPLACE = """
local ttl = redis.call('PTTL', KEYS[1])
if ttl <= 0 then return 0 end
redis.call('DEL', KEYS[2])
for i = 1, #ARGV, 5000 do
  redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 4999, #ARGV)))
end
if #ARGV > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return 1
"""


class PrefixIndex:
    def __init__(self, r: redis.Redis, keys: KeySpace):
        self._r = r
        self._keys = keys
        self._update = r.register_script(_UPDATE)
        self._replace = r.register_script(_REPLACE)

    def publish_prefix(self, instance_id: str, added_hashes: Sequence[int],
                       removed_hashes: Sequence[int]) -> bool:
        """Apply a delta to the instance's set (removals first). False, and nothing written, if
        the instance is not registered."""
        if not added_hashes and not removed_hashes:
            return self._r.exists(self._keys.instance(instance_id)) == 1
        args = [len(removed_hashes), *map(int, removed_hashes), *map(int, added_hashes)]
        keys = [self._keys.instance(instance_id), self._keys.prefix(instance_id)]
        return self._update(keys=keys, args=args) == 1

    def replace_prefix(self, instance_id: str, hashes: Sequence[int]) -> bool:
        """Replace the instance's whole set (after a re-registration: see Heartbeat)."""
        keys = [self._keys.instance(instance_id), self._keys.prefix(instance_id)]
        return self._replace(keys=keys, args=list(map(int, hashes))) == 1

    def match_prefix(self, instance_ids: Sequence[str],
                     block_hashes: Sequence[int]) -> dict[str, int]:
        """For each instance, how many leading blocks of block_hashes it holds.

        Hashes are chained, so a held hash means the whole prefix up to it was computed; the count
        still stops at the first missing hash (that block may have been evicted). One pipelined
        round trip for all instances (SMISMEMBER each)."""
        if not block_hashes or not instance_ids:
            return dict.fromkeys(instance_ids, 0)
        members = [int(h) for h in block_hashes]
        pipe = self._r.pipeline(transaction=False)
        for instance_id in instance_ids:
            pipe.smismember(self._keys.prefix(instance_id), members)
        result: dict[str, int] = {}
        for instance_id, flags in zip(instance_ids, pipe.execute(), strict=True):
            n = 0
            while n < len(flags) and flags[n]:
                n += 1
            result[instance_id] = n
        return result
