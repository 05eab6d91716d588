"""Heartbeat: keeps one instance registered, with fresh load figures, from a background thread."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

import redis

from common.registry.records import InstanceInfo
from common.registry.registry import Registry

log = logging.getLogger(__name__)


class Heartbeat:
    """Re-registers `info` every ttl_s / 3 seconds.

    start() registers once in the caller's thread (so a dead registry fails start-up loudly),
    then refreshes in a daemon thread. A refresh that finds the record missing (Redis restarted,
    or this process stalled past its TTL) re-creates it and calls on_reregister from the heartbeat
    thread: the instance's prefix set was lost with it, so the service should republish it
    (Registry.replace_prefix). Keep the callback cheap, e.g. set a flag the service loop
    reads. Redis errors during refreshes are logged and retried on the next beat.
    """

    def __init__(self, registry: Registry, info: InstanceInfo, ttl_s: float,
                 on_reregister: Callable[[], None] | None = None):
        if ttl_s <= 0:
            raise ValueError(f"ttl must be positive, got {ttl_s}")
        self.registry = registry
        self.ttl_s = ttl_s
        self.interval_s = ttl_s / 3
        self.on_reregister = on_reregister
        self.reregistrations = 0   # records found missing and re-created
        self.errors = 0            # refreshes that failed (Redis unreachable)
        self._info = info
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def info(self) -> InstanceInfo:
        with self._lock:
            return self._info

    def update(self, **load: int) -> None:
        """New load figures (num_waiting, num_running, free_blocks, total_blocks), published with
        the next beat. Safe to call from any thread."""
        with self._lock:
            self._info = dataclasses.replace(self._info, **load)

    def start(self) -> Heartbeat:
        if self._thread is not None:
            raise RuntimeError("heartbeat already started")
        self.registry.register(self.info, self.ttl_s)
        self._thread = threading.Thread(target=self._run, name="registry-heartbeat", daemon=True)
        self._thread.start()
        return self

    def beat(self) -> None:
        """One refresh (the thread's loop body; public so tests can drive it)."""
        if self.registry.register(self.info, self.ttl_s):
            self.reregistrations += 1
            log.warning("registry record of %s was missing; re-registered",
                        self._info.instance_id)
            if self.on_reregister is not None:
                self.on_reregister()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except redis.RedisError as e:
                self.errors += 1
                log.warning("registry heartbeat failed: %s", e)

    def stop(self, deregister: bool = True) -> None:
        """Stop beating; with deregister, remove the record now instead of letting it expire."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)
            self._thread = None
        if deregister:
            self.registry.deregister(self.info.instance_id)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
