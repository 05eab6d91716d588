"""Registry: the one shared store of splitserve, on Redis (service discovery and the prefix
index; KV handoffs go from service to service and never through it). Importable without torch
(the gateway uses it).

Every call has a socket timeout, and connection errors and timeouts are retried with exponential
backoff (with jitter); the Lua scripts are idempotent for their caller so a retry after a lost
reply does no harm. Every key lives under "<namespace>:"; after each instance's clear_instance the
namespace is empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from common.registry.discovery import Discovery
from common.registry.keys import KeySpace
from common.registry.prefix_index import PrefixIndex
from common.registry.records import InstanceInfo


def connect(url: str, timeout_s: float, retries: int) -> redis.Redis:
    """A client for redis:// or rediss:// URLs (user:password@ for AUTH, /db for the database)."""
    if timeout_s <= 0 or retries < 0:
        raise ValueError(f"need timeout_s > 0 and retries >= 0, got {timeout_s}, {retries}")
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), retries),
        health_check_interval=30,
    )


class Registry:
    """Thread-safe (redis-py pools its connections); one per process is enough."""

    def __init__(self, url: str, namespace: str = "splitserve", *, timeout_s: float = 2.0,
                 retries: int = 3):
        self.url = url
        self.keys = KeySpace(namespace)
        self.redis = connect(url, timeout_s, retries)
        self._discovery = Discovery(self.redis, self.keys)
        self._prefixes = PrefixIndex(self.redis, self.keys)

    @property
    def namespace(self) -> str:
        return self.keys.namespace

    def ping(self) -> bool:
        return bool(self.redis.ping())

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- service discovery (see discovery.py) ---------------------------------------------
    def register(self, instance: InstanceInfo, ttl_s: float) -> bool:
        return self._discovery.register(instance, ttl_s)

    def deregister(self, instance_id: str) -> None:
        self._discovery.deregister(instance_id)

    def list_instances(self, kind: str) -> list[InstanceInfo]:
        return self._discovery.list_instances(kind)

    def get_instance(self, instance_id: str) -> InstanceInfo | None:
        return self._discovery.get_instance(instance_id)

    # ---- prefix index (see prefix_index.py) ------------------------------------------------
    def publish_prefix(self, instance_id: str, added_hashes: Sequence[int],
                       removed_hashes: Sequence[int]) -> bool:
        return self._prefixes.publish_prefix(instance_id, added_hashes, removed_hashes)

    def replace_prefix(self, instance_id: str, hashes: Sequence[int]) -> bool:
        return self._prefixes.replace_prefix(instance_id, hashes)

    def match_prefix(self, instance_ids: Sequence[str],
                     block_hashes: Sequence[int]) -> dict[str, int]:
        return self._prefixes.match_prefix(instance_ids, block_hashes)

    # ---- shutdown --------------------------------------------------------------------------
    def clear_instance(self, instance_id: str) -> None:
        """Remove every key of an instance: its record and prefix set. A prefill service calls
        it at clean shutdown, after its deliveries ended."""
        self._discovery.deregister(instance_id)

    def namespace_keys(self) -> list[str]:
        """Every key under the namespace (tests and diagnostics)."""
        return sorted(self.redis.scan_iter(match=self.keys.all(), count=1000))
