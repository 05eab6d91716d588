"""Runs one decode service: engine, gRPC server with the Decode service, registry record."""

from __future__ import annotations

import asyncio
import logging

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.registry import Registry
from common.serving import tracing
from common.serving.datagram import open_listener
from common.serving.doorbell import DoorbellListener
from common.serving.express import ExpressReplier
from common.serving.grpc_util import GrpcServer, Service, service_name
from common.serving.instance import ServiceInstance
from common.serving.metrics import DecodeMetrics
from common.serving.tls import PLAINTEXT, TlsConfig
from decode_service.config import DecodeServiceConfig
from decode_service.handoff import HandoffInbox
from decode_service.servicer import DecodeServicer
from protos.splitserve.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger("splitserve.decode")


async def serve(config: DecodeServiceConfig, engine_config: EngineConfig,
                tls: TlsConfig = PLAINTEXT) -> None:
    registry = Registry(config.registry.url, config.registry.namespace)
    registry.ping()  # an unreachable registry fails start-up, before the model loads
    engine = LLMEngine(engine_config)
    server = GrpcServer(config.server.host, config.port, tls=tls)
    instance = ServiceInstance("decode", config, engine, registry, config.address(server.port))
    config.server.apply()
    tracing.configure("decode", config.server.otlp_endpoint, instance.instance_id)
    metrics = DecodeMetrics(engine.model_name, config.slo.objective, instance.engine_stats)
    inbox = HandoffInbox(registry, instance.loop, config.pull_timeout_s, metrics,
                         wait_s=config.deliver_wait_s, peer_check_s=config.peer_check_s, tls=tls,
                         early_copy_on_device=config.early_copy_on_device,
                         admit_wait_ms=config.admit_wait_ms)
    # The engine thread's express replies to gateways of this host (plaintext only).
    lane = ExpressReplier() if config.express and not tls.serves_tls else None
    server.add(Service(DecodeServicer(instance, inbox, metrics, lane),
                       decode_pb2_grpc.add_DecodeServiceServicer_to_server,
                       service_name(decode_pb2, "DecodeService")))
    doorbell = _open_doorbell(config, tls, instance.address, inbox)
    listen = config.server
    metrics_server = metrics.serve(listen.host, listen.metrics_port,
                                   instance.health) if listen.metrics_port else None
    await server.start(serving=False)  # health: NOT_SERVING until registered
    await instance.start(server)
    maintain = asyncio.create_task(_maintain(instance, config.stats_interval_s))
    try:
        await instance.wait()
    finally:
        await instance.stop(server, config.server.shutdown_grace_s, [maintain],
                            close=[*([doorbell.close] if doorbell else []), inbox.close,
                                   *([metrics_server.close] if metrics_server else []),
                                   *([lane.close] if lane else [])])
        tracing.shutdown()
    if instance.failure:  # stopped because the engine cannot step: exit 1, saying why
        raise SystemExit(f"{instance.kind} {instance.instance_id} stopped: {instance.failure}")


def _open_doorbell(config: DecodeServiceConfig, tls: TlsConfig, address: str,
                   inbox: HandoffInbox) -> DoorbellListener | None:
    """The delivery doorbell on this event loop, unless turned off or serving TLS."""
    return open_listener(config.doorbell, tls,
                         lambda: DoorbellListener(address, inbox.ring).start(), log,
                         f"delivery doorbell for {address}",
                         "deliveries take the gRPC call only")


async def _maintain(instance: ServiceInstance, interval_s: float) -> None:
    """Refresh the load figures sent with each heartbeat."""
    while True:
        try:
            await instance.refresh_load()
        except Exception:
            log.exception("refreshing the load figures failed")
        await asyncio.sleep(interval_s)
