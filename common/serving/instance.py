"""What a prefill and a decode service share: the instance settings (address, registry, heartbeat),
and one running instance: an engine on its loop thread, registered in the block registry with its
load refreshed, answering Stats. The two services add their own RPCs on top.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.kv_transport.locality import host_id
from common.registry import BlockRegistry, Heartbeat, InstanceInfo, InstanceKind
from common.serving.engine_loop import EngineLoop
from common.serving.metrics import SLO, EngineStats, engine_stats
from protos.splitserve.v1 import types_pb2

if TYPE_CHECKING:
    from common.engine.engine import LLMEngine

log = logging.getLogger("splitserve.instance")

SCRAPE_TIMEOUT_S = 5.0  # a /metrics scrape waits at most this long for the engine's thread


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    registry_url: str = "redis://127.0.0.1:6379/0"
    registry_namespace: str = "splitserve"
    instance_id: str | None = None
    heartbeat_ttl_s: float = 3.0
    stats_interval_s: float = 0.25
    shutdown_grace_s: float = 5.0
    metrics_port: int = 0
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0

    HELP = {
        "host": "address the gRPC server listens on (0.0.0.0 for every interface)",
        "port": "gRPC port (0 picks a free one; the registry tells the gateway which)",
        "advertise_host": "host name or IP other services dial; unset: --host, or this "
                          "machine's IP when listening on every interface)",
        "registry_url": "Redis URL of the block registry",
        "registry_namespace": "key prefix shared by every service of one stack",
        "instance_id": "id in the registry; unset: <kind>-<hostname>-<pid>",
        "heartbeat_ttl_s": "registry record lifetime; refreshed every third of it, so a dead "
                           "instance disappears within it",
        "stats_interval_s": "how often the load figures sent with the heartbeat are refreshed",
        "shutdown_grace_s": "on SIGTERM, how long in-flight requests may finish",
        "metrics_port": "port of Prometheus /metrics (0 = off)",
        "slo_ttft_ms": "goodput: time-to-first-token objective in ms (prefill; 0 = none)",
        "slo_tpot_ms": "goodput: time-per-output-token objective in ms (decode; 0 = none)",
    }

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port out of range: {self.port}")
        if self.heartbeat_ttl_s <= 0 or self.stats_interval_s <= 0:
            raise ValueError("--heartbeat-ttl-s and --stats-interval-s must be positive")
        if self.shutdown_grace_s < 0:
            raise ValueError("--shutdown-grace-s must be >= 0")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port out of range: {self.metrics_port}")
        if self.slo_ttft_ms < 0 or self.slo_tpot_ms < 0:
            raise ValueError("SLOs must be >= 0 (0 = none)")

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft_ms / 1000, self.slo_tpot_ms / 1000)

    def resolved_instance_id(self, kind: str) -> str:
        return self.instance_id or f"{kind}-{socket.gethostname()}-{os.getpid()}"

    def address(self, port: int) -> str:
        host = self.advertise_host or self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{port}"


class ServiceInstance:
    """An engine on its loop, its registry record kept alive with fresh load figures."""

    def __init__(self, kind: InstanceKind, config: InstanceConfig, engine: LLMEngine,
                 registry: BlockRegistry, address: str):
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
                            block_size=engine.config.block_size,
                            total_blocks=engine.block_manager.num_blocks,
                            free_blocks=engine.block_manager.num_free_blocks)
        self.heartbeat = Heartbeat(registry, info, config.heartbeat_ttl_s)

    def start(self) -> None:
        self.loop.start()
        self.heartbeat.start()
        log.info("%s %s serving %s at %s", self.kind, self.instance_id, self.engine.model_name,
                 self.address)

    async def stats(self, **extra: int) -> types_pb2.InstanceStats:
        """Block accounting read on the engine's thread (a consistent snapshot)."""
        counts = await asyncio.wrap_future(self.loop.call(engine_counts))
        return types_pb2.InstanceStats(
            instance_id=self.instance_id, role=self.kind, address=self.address,
            model=self.engine.model_name, block_size=self.engine.config.block_size,
            num_inflight=self.num_inflight, max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.model_config.vocab_size, **counts, **extra)

    async def refresh_load(self) -> None:
        counts = await asyncio.wrap_future(self.loop.call(engine_counts))
        self.heartbeat.update(num_waiting=counts["num_waiting"],
                              num_running=counts["num_running"],
                              free_blocks=counts["num_free_blocks"])

    def engine_stats(self) -> EngineStats:
        """A snapshot for /metrics, taken on the engine's thread (blocks the scraping thread
        until the current step ends)."""
        return self.loop.call(engine_stats).result(timeout=SCRAPE_TIMEOUT_S)

    def stop(self) -> None:
        """Leave the registry first (no new requests are routed here), then stop the engine."""
        self.heartbeat.stop(deregister=True)
        self.loop.stop()


def engine_counts(engine: LLMEngine) -> dict[str, int]:
    bm = engine.block_manager
    return {"num_kv_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
            "num_used_blocks": bm.num_used_blocks, "num_cached_blocks": len(bm.cached),
            "num_running": engine.num_running, "num_waiting": engine.num_waiting,
            "num_held_handoffs": len(engine.held)}
