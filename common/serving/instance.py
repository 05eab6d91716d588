"""What a prefill and a decode service share: the instance settings (address, registry, heartbeat),
and one running instance: an engine on its loop thread, registered in the block registry with its
load refreshed, answering Stats. The two services add their own RPCs on top.

Readiness: the gRPC health (and /health beside /metrics) says NOT_SERVING until the instance is
registered (its model is loaded before), SERVING from then on, and NOT_SERVING again from the
first step of `stop`, before the record leaves the registry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.flags import group, opt
from common.kv_transport.locality import host_id
from common.registry import Heartbeat, InstanceInfo, InstanceKind, Registry
from common.serving.config import RegistryConfig, ServerConfig, SLOConfig
from common.serving.engine_loop import EngineLoop
from common.serving.grpc_util import wait_for_signal
from common.serving.metrics import EngineStats, engine_stats
from protos.splitserve.v1 import types_pb2

if TYPE_CHECKING:
    from common.engine.engine import LLMEngine
    from common.serving.grpc_util import GrpcServer

log = logging.getLogger("splitserve.instance")

SCRAPE_TIMEOUT_S = 5.0  # a /metrics scrape waits at most this long for the engine's thread


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    """A prefill or decode service's own settings; each service's config extends it."""
    server: ServerConfig = group(ServerConfig, "server")
    registry: RegistryConfig = group(RegistryConfig)
    slo: SLOConfig = group(SLOConfig, "SLO")
    port: int = opt(0, "gRPC port (0 picks a free one; the registry tells the gateway which)")
    advertise_host: str | None = opt(None, "host name or IP other services dial; unset: --host, "
                                     "or this machine's IP when listening on every interface)")
    instance_id: str | None = opt(None, "id in the registry; unset: <kind>-<hostname>-<pid>")
    heartbeat_ttl_s: float = opt(3.0, "registry record lifetime; refreshed every third of it, "
                                 "so a dead instance disappears within it")
    stats_interval_s: float = opt(0.25, "how often the load figures sent with the heartbeat are "
                                  "refreshed")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port out of range: {self.port}")
        if self.heartbeat_ttl_s <= 0 or self.stats_interval_s <= 0:
            raise ValueError("--heartbeat-ttl-s and --stats-interval-s must be positive")

    def resolved_instance_id(self, kind: str) -> str:
        return self.instance_id or f"{kind}-{socket.gethostname()}-{os.getpid()}"

    def address(self, port: int) -> str:
        host = self.advertise_host or self.server.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{port}"


class ServiceInstance:
    """An engine on its loop, its registry record kept alive with fresh load figures."""

    def __init__(self, kind: InstanceKind, config: InstanceConfig, engine: LLMEngine,
                 registry: Registry, address: str):
        self.kind = kind
        self.config = config
        self.engine = engine
        self.registry = registry
        self.address = address
        self.instance_id = config.resolved_instance_id(kind)
        self.loop = EngineLoop(engine, name=f"{kind}-engine")
        self.num_inflight = 0  # RPCs computing or streaming for a caller (event-loop thread)
        info = InstanceInfo(instance_id=self.instance_id, kind=kind, address=address,
                            model=engine.model_name, host_id=host_id(),
                            block_size=engine.config.cache.block_size,
                            total_blocks=engine.block_manager.num_blocks,
                            free_blocks=engine.block_manager.num_free_blocks,
                            tensor_parallel_size=engine.config.parallel.tensor_parallel_size)
        self.heartbeat = Heartbeat(registry, info, config.heartbeat_ttl_s)
        self.ready = False  # registered and not draining
        self.failure: str | None = None  # why the engine cannot serve any more (a rank died)
        self._failed: asyncio.Future | None = None

    async def start(self, server: GrpcServer) -> None:
        """Start the engine's thread, register, then report SERVING on `server` (started with
        serving=False)."""
        aio = asyncio.get_running_loop()
        self._failed = aio.create_future()

        def fail(why: object) -> None:  # any thread: a tensor-parallel rank is gone
            self.failure = self.failure or str(why)
            aio.call_soon_threadsafe(lambda: self._failed.done() or self._failed.set_result(None))
        self.loop.on_fatal = fail
        if self.engine.ranks is not None:
            self.engine.ranks.on_failure = fail
        self.loop.start()
        self.heartbeat.start()
        self.ready = True
        await server.set_serving(True)
        log.info("%s %s serving %s at %s", self.kind, self.instance_id, self.engine.model_name,
                 self.address)

    async def wait(self) -> None:
        """Until SIGINT or SIGTERM, or the engine can no longer step (a tensor-parallel rank
        died: `failure` says why; the instance then stops as on SIGTERM, and its requests,
        ended UNAVAILABLE, are migrated by the gateway)."""
        signalled = asyncio.ensure_future(wait_for_signal())
        await asyncio.wait([signalled, self._failed], return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if self.failure:
            log.error("%s %s cannot serve: %s; stopping", self.kind, self.instance_id,
                      self.failure)

    async def stats(self, **extra: int) -> types_pb2.InstanceStats:
        """Block accounting read on the engine's thread (a consistent snapshot)."""
        counts = await asyncio.wrap_future(self.loop.call(engine_counts))
        return types_pb2.InstanceStats(
            instance_id=self.instance_id, role=self.kind, address=self.address,
            model=self.engine.model_name, block_size=self.engine.config.cache.block_size,
            num_inflight=self.num_inflight, max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.model_config.vocab_size, **counts, **extra)

    async def refresh_load(self) -> None:
        counts = await asyncio.wrap_future(self.loop.call(engine_counts))
        self.heartbeat.update(num_waiting=counts["num_waiting"],
                              num_running=counts["num_running"],
                              free_blocks=counts["num_free_blocks"])

    def health(self) -> dict:
        """The body of /health on the metrics port (common/serving/metrics.py)."""
        return {"status": "ready" if self.ready else "not ready", "kind": self.kind,
                "instance_id": self.instance_id}

    def engine_stats(self) -> EngineStats:
        """A snapshot for /metrics, taken on the engine's thread (blocks the scraping thread
        until the current step ends)."""
        return self.loop.call(engine_stats).result(timeout=SCRAPE_TIMEOUT_S)

    async def stop(self, server: GrpcServer, grace_s: float,
                   background: Sequence[asyncio.Task] = (), *,
                   drain: Callable[[], Awaitable[None]] | None = None,
                   close: Sequence[Callable[[], None]] = (),
                   close_after_engine: Sequence[Callable[[], None]] = ()) -> None:
        """The shutdown order of both services, each step before the next:

        1. report NOT_SERVING and leave the registry (the gateway stops routing here);
        2. let in-flight RPCs finish for `grace_s`, then stop the gRPC server;
        3. cancel the service's background tasks;
        4. `drain()`: give back what the service holds for others (prefill: let its deliveries in
           flight end);
        5. `close` (metrics server, the handoff inbox), then stop the engine's thread;
        6. `close_after_engine` (what the engine's pool lives in), then the registry client.
        """
        stopping = time.monotonic()
        log.info("%s %s stopping", self.kind, self.instance_id)
        self.ready = False
        await server.set_serving(False)
        self.heartbeat.stop(deregister=True)
        await server.stop(grace_s)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if drain is not None:
            await drain()
        for step in close:
            step()
        self.loop.stop()
        self.engine.close()  # the other tensor-parallel ranks, if any
        for step in close_after_engine:
            step()
        self.registry.close()
        log.info("%s %s stopped in %.1f s", self.kind, self.instance_id,
                 time.monotonic() - stopping)


def engine_counts(engine: LLMEngine) -> dict[str, int]:
    bm = engine.block_manager
    return {"num_kv_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
            "num_used_blocks": bm.num_used_blocks, "num_cached_blocks": len(bm.cached),
            "num_running": engine.num_running, "num_waiting": engine.num_waiting,
            "num_held_handoffs": len(engine.kv.held)}
