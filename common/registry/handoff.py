"""Handoff records: how a request's prompt KV passes from a prefill to a decode service.

Life of a record (one Redis hash per request, expiring with its lease):

    prefill: publish_handoff(desc, lease)            record {desc, source}, TTL = lease
    decode:  claim_handoff(rid, me) -> desc          exactly one claimer wins (Lua, atomic)
    decode:  renew_lease(rid, ttl)  (while pulling)  keeps the record alive
    decode:  pull the blocks, then complete_handoff  deletes the record, writes a `done` marker
    prefill: reap_handoffs([rid, ...])               DONE / EXPIRED -> release the blocks

Lease rule: the prefill side keeps a handoff's blocks pinned while its record exists, and releases
them once it is gone: deleted by the decode side's confirmation (state DONE: a short-lived `done`
marker tells it apart) or expired with its lease (state EXPIRED). A record never comes back once
gone, so when complete_handoff returns True the record, and with it the source blocks, lived
through the whole pull; when it returns False the lease ran out first and the source may already
have reused the blocks: the decode side must discard what it pulled.

Every script is idempotent for its caller, so the client's retries after a lost reply are safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from common.registry.discovery import scan_keys
from common.registry.keys import KeySpace
from common.registry.records import HandoffDescriptor, HandoffState

# KEYS: handoff. ARGV: desc, source, lease_ms. Publishing the same descriptor twice is a no-op.
_PUBLISH = """
local cur = redis.call('HGET', KEYS[1], 'desc')
if cur then
  if cur == ARGV[1] then return 1 end
  return 0
end
redis.call('HSET', KEYS[1], 'desc', ARGV[1], 'source', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: handoff. ARGV: claimer. The first claimer wins; the winner may claim again (retries).
_CLAIM = """
local desc = redis.call('HGET', KEYS[1], 'desc')
if not desc then return false end
local owner = redis.call('HGET', KEYS[1], 'claimer')
if owner and owner ~= ARGV[1] then return false end
if not owner then redis.call('HSET', KEYS[1], 'claimer', ARGV[1]) end
return desc
"""

# KEYS: handoff, done. ARGV: done_ttl_ms, claimer ('' = any).
# 1: confirmed (now or by an earlier call), 0: the record had expired, -1: claimed by another.
_COMPLETE = """
local src = redis.call('HGET', KEYS[1], 'source')
if not src then
  return redis.call('EXISTS', KEYS[2])
end
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'claimer') ~= ARGV[2] then return -1 end
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], src, 'PX', ARGV[1])
return 1
"""


class HandoffStore:
    def __init__(self, r: redis.Redis, keys: KeySpace, done_ttl_s: float):
        if done_ttl_s <= 0:
            raise ValueError(f"done_ttl_s must be positive, got {done_ttl_s}")
        self._r = r
        self._keys = keys
        self._done_ttl_ms = round(done_ttl_s * 1000)
        self._publish = r.register_script(_PUBLISH)
        self._claim = r.register_script(_CLAIM)
        self._complete = r.register_script(_COMPLETE)

    def publish_handoff(self, desc: HandoffDescriptor, lease_ttl_s: float) -> None:
        """Publish a handoff; its blocks stay pinned on the source until the record is gone."""
        if lease_ttl_s <= 0:
            raise ValueError(f"lease must be positive, got {lease_ttl_s}")
        args = [desc.to_json(), desc.source_instance, max(1, round(lease_ttl_s * 1000))]
        if self._publish(keys=[self._keys.handoff(desc.request_id)], args=args) != 1:
            raise ValueError(f"a different handoff for request {desc.request_id!r} exists")

    def claim_handoff(self, request_id: str, claimer: str) -> HandoffDescriptor | None:
        """The descriptor if `claimer` won the claim (or had already won it); None if the record
        is gone or another claimer holds it."""
        if not claimer:
            raise ValueError("claimer must not be empty")
        desc = self._claim(keys=[self._keys.handoff(request_id)], args=[claimer])
        return None if desc is None else HandoffDescriptor.from_json(desc)

    def renew_lease(self, request_id: str, ttl_s: float) -> bool:
        """Set the record's remaining lease to ttl_s; False if it is already gone."""
        return bool(self._r.pexpire(self._keys.handoff(request_id), max(1, round(ttl_s * 1000))))

    def complete_handoff(self, request_id: str, claimer: str | None = None) -> bool:
        """Decode side confirms it holds the KV: delete the record, mark it done (for done_ttl_s).

        False if the lease had expired first (discard the pulled KV, see the module docstring) or,
        with `claimer`, if someone else holds the claim."""
        keys = [self._keys.handoff(request_id), self._keys.done(request_id)]
        return self._complete(keys=keys, args=[self._done_ttl_ms, claimer or ""]) == 1

    def cancel_handoff(self, request_id: str) -> bool:
        """Prefill side withdraws a handoff (request aborted); reads as EXPIRED afterwards. A
        done marker goes too: a confirmation that raced the withdrawal would otherwise leave one
        that no poll reaps (the source releases the blocks itself). True if the record was
        still there."""
        with self._r.pipeline() as pipe:  # MULTI/EXEC: both keys or neither
            pipe.delete(self._keys.handoff(request_id))
            pipe.delete(self._keys.done(request_id))
            deleted, _ = pipe.execute()
        return deleted == 1

    def handoff_exists(self, request_id: str) -> bool:
        return self._r.exists(self._keys.handoff(request_id)) == 1

    def handoff_states(self, request_ids: Sequence[str]) -> dict[str, HandoffState]:
        """State of each handoff, in one round trip; reads only."""
        pipe = self._r.pipeline(transaction=False)
        for rid in request_ids:
            pipe.hmget(self._keys.handoff(rid), ["source", "claimer"])
            pipe.exists(self._keys.done(rid))
        replies = pipe.execute()
        states: dict[str, HandoffState] = {}
        for i, rid in enumerate(request_ids):
            (source, claimer), done = replies[2 * i], replies[2 * i + 1]
            if source is not None:
                states[rid] = HandoffState.CLAIMED if claimer else HandoffState.PENDING
            else:
                states[rid] = HandoffState.DONE if done else HandoffState.EXPIRED
        return states

    def reap_handoffs(self, request_ids: Sequence[str]) -> dict[str, HandoffState]:
        """handoff_states, and delete the done markers of the DONE ones (the source's poll loop
        calls this; it releases the blocks of every finished handoff). A marker lives done_ttl_s:
        poll more often than that, or a confirmed handoff reads as EXPIRED (metrics only)."""
        states = self.handoff_states(request_ids)
        done = [self._keys.done(rid) for rid, s in states.items() if s is HandoffState.DONE]
        if done:
            self._r.delete(*done)
        return states

    def list_handoffs(self, source_instance: str) -> list[HandoffDescriptor]:
        """Live handoffs published by one instance, sorted by request_id (scans all handoffs)."""
        keys = scan_keys(self._r, self._keys.pattern("handoff"))
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, ["source", "desc"])
        found = [HandoffDescriptor.from_json(desc) for source, desc in pipe.execute()
                 if source == source_instance and desc is not None]
        return sorted(found, key=lambda d: d.request_id)

    def clear_source(self, source_instance: str) -> int:
        """Delete every handoff record and done marker of one source; the number deleted."""
        doomed = [self._keys.handoff(d.request_id) for d in self.list_handoffs(source_instance)]
        done_keys = scan_keys(self._r, self._keys.pattern("done"))
        if done_keys:
            doomed += [k for k, v in zip(done_keys, self._r.mget(done_keys), strict=True)
                       if v == source_instance]
        return int(self._r.delete(*doomed)) if doomed else 0
