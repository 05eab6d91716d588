"""Runs one prefill service: engine (KV pool in shared memory on CPU), gRPC server with the
Prefill and KVTransferService services, registry record, KV deliveries, prefix index updates."""

from __future__ import annotations

import asyncio
import logging

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine, resolve_device
from common.engine.rank_kv import RankShards
from common.kv_transport.grpc_transport import KVTransferServicer
from common.kv_transport.shm import SharedMemoryPool
from common.kv_transport.shm_sweep import sweep_stale_pools
from common.kv_transport.source import KVSource
from common.registry import Registry
from common.serving import tracing
from common.serving.datagram import open_listener
from common.serving.express import ExpressListener
from common.serving.grpc_util import GrpcServer, Service, service_name
from common.serving.instance import ServiceInstance
from common.serving.metrics import PrefillMetrics
from common.serving.tls import PLAINTEXT, TlsConfig
from prefill_service.config import PrefillServiceConfig
from prefill_service.delivery import Deliveries
from prefill_service.prefix_sync import PrefixSync
from prefill_service.servicer import PrefillServicer
from protos.splitserve.v1 import (
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

log = logging.getLogger("splitserve.prefill")


async def serve(config: PrefillServiceConfig, engine_config: EngineConfig,
                tls: TlsConfig = PLAINTEXT) -> None:
    registry = Registry(config.registry.url, config.registry.namespace)
    registry.ping()  # an unreachable registry fails start-up, before the model loads
    shm = None
    if resolve_device(engine_config.model.device).type == "cpu":
        sweep_stale_pools()  # pools left by killed prefill services hold RAM until removed
        shm = SharedMemoryPool()
    engine = LLMEngine(engine_config, kv_cache_allocator=shm)
    server = GrpcServer(config.server.host, config.port, tls=tls)
    instance = ServiceInstance("prefill", config, engine, registry, config.address(server.port))
    config.server.apply()
    tracing.configure("prefill", config.server.otlp_endpoint, instance.instance_id)
    source = KVSource(instance.instance_id, engine.kv_cache, engine.model_name,
                      address=instance.address, shm=shm, shards=RankShards.of(engine))
    metrics = PrefillMetrics(engine.model_name, config.slo.objective, instance.engine_stats)
    deliveries = Deliveries(instance.loop, config.handoff_lease_s, metrics, tls=tls)
    prefixes = PrefixSync(registry, instance.loop, instance.instance_id)
    instance.heartbeat.on_reregister = lambda: setattr(prefixes, "republish", True)
    servicer = PrefillServicer(instance, source, deliveries, prefixes, metrics,
                               early_handoff=config.early_handoff)
    server.add(Service(servicer, prefill_pb2_grpc.add_PrefillServiceServicer_to_server,
                       service_name(prefill_pb2, "PrefillService")))
    server.add(Service(KVTransferServicer(source),
                       kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server,
                       service_name(kv_transfer_pb2, "KVTransferService")))
    listen = config.server
    metrics_server = metrics.serve(listen.host, listen.metrics_port,
                                   instance.health) if listen.metrics_port else None
    await server.start(serving=False)  # health: NOT_SERVING until registered
    servicer.lane = _open_express(config, tls, instance.address, servicer)
    await instance.start(server)
    background = [asyncio.create_task(_maintain(instance, prefixes, config))]
    try:
        await instance.wait()
    finally:
        async def drain() -> None:
            await deliveries.close()
            registry.clear_instance(instance.instance_id)

        await instance.stop(server, config.server.shutdown_grace_s, background, drain=drain,
                            close=[*([metrics_server.close] if metrics_server else []),
                                   *([servicer.lane.close] if servicer.lane else [])],
                            close_after_engine=[source.close, *([shm.close] if shm else [])])
        tracing.shutdown()
    if instance.failure:  # stopped because the engine cannot step: exit 1, saying why
        raise SystemExit(f"{instance.kind} {instance.instance_id} stopped: {instance.failure}")


def _open_express(config: PrefillServiceConfig, tls: TlsConfig, address: str,
                  servicer: PrefillServicer) -> ExpressListener | None:
    """The express socket on this event loop, unless turned off or serving TLS."""
    return open_listener(config.express, tls,
                         lambda: ExpressListener(address, servicer.on_express).start(), log,
                         f"express socket for {address}", "prompts wait for their Prefill call")


async def _maintain(instance: ServiceInstance, prefixes: PrefixSync,
                    config: PrefillServiceConfig) -> None:
    """Refresh the load sent with each heartbeat; publish prefix-cache evictions."""
    loop = asyncio.get_running_loop()
    next_sync = loop.time()
    while True:
        try:
            await instance.refresh_load()
            if loop.time() >= next_sync or prefixes.republish:
                next_sync = loop.time() + config.prefix_sync_interval_s
                await prefixes.sync()
        except Exception:
            log.exception("refreshing the load figures or the prefix index failed")
        await asyncio.sleep(config.stats_interval_s)
