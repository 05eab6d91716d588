"""Runs the gateway: tokenizer and model metadata, registry view, router, public gRPC server,
the OpenAI-compatible HTTP API (--http-port) and /metrics (--metrics-port)."""

from __future__ import annotations

import asyncio
import logging
import time

from common.registry import Registry
from common.serving import tracing
from common.serving.auth import NO_AUTH, ApiKeyInterceptor, ApiKeyMiddleware, AuthConfig
from common.serving.express import ExpressClient
from common.serving.grpc_util import GrpcServer, Service, service_name, wait_for_signal
from common.serving.metrics import GatewayMetrics
from common.serving.tls import PLAINTEXT, TlsConfig
from common.text.tokenizer import Tokenizer
from gateway.config import GatewayConfig
from gateway.frontend import Frontend
from gateway.http_api import OpenAIApi, create_app
from gateway.http_server import HttpServer
from gateway.instances import Instances
from gateway.migration import Migrator
from gateway.model_files import wait_for_model_files
from gateway.quarantine import Quarantine
from gateway.readiness import Readiness
from gateway.relay import Relay
from gateway.resume import ResumableStreams
from gateway.router import Router
from gateway.servicer import GenerationServicer
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("splitserve.gateway")


def build_frontend(config: GatewayConfig) -> tuple[Frontend, tuple[int, ...]]:
    if config.model.startswith("dummy:"):
        return Frontend(config.model_name, None, 0, 0, max_n=config.max_n), ()
    files = wait_for_model_files(config.model, config.model_cache_dir, config.tokenizer,
                                 config.model_wait_s)
    tokenizer = Tokenizer.from_dir(files.directory)
    frontend = Frontend(config.model_name, tokenizer, files.max_model_len, files.vocab_size,
                        max_n=config.max_n)
    return frontend, tokenizer.eos_token_ids


async def serve(config: GatewayConfig, tls: TlsConfig = PLAINTEXT,
                auth: AuthConfig = NO_AUTH) -> None:
    registry = Registry(config.registry.url, config.registry.namespace)
    registry.ping()
    config.server.apply()
    tracing.configure("gateway", config.server.otlp_endpoint)
    keys = auth.keys()
    frontend, eos_token_ids = await asyncio.to_thread(build_frontend, config)
    quarantine = Quarantine(config.quarantine_s)
    instances = Instances(registry, config.discovery_interval_s, tls, quarantine)
    router = Router(config.router)
    # The express lane to prefill services on this host (plaintext only: no credentials).
    express = ExpressClient().start() if config.express and not tls.dials_tls else None
    relay = Relay(config, registry, instances, router, express)
    migrator = Migrator(relay, instances, quarantine, frontend.tokenizer,
                        config.migration, tls)
    resumable = ResumableStreams(config.resume_retention_s)
    # Scraped only once serving, when `servicer` exists.
    metrics = GatewayMetrics(frontend.model_name,
                             config.slo.objective,
                             lambda: len(servicer.inflight))
    servicer = GenerationServicer(config, frontend, migrator, instances, eos_token_ids, metrics,
                                  resumable)
    server = GrpcServer(config.server.host, config.grpc_port, tls=tls,
                        interceptors=[ApiKeyInterceptor(keys)] if keys.enabled else [])
    server.add(Service(servicer, generation_pb2_grpc.add_GenerationServiceServicer_to_server,
                       service_name(generation_pb2, "GenerationService")))
    readiness = Readiness(instances, server)
    await server.start(serving=False)  # SERVING once a prefill and a decode instance are known
    http = None
    if config.http_port:
        app = create_app(OpenAIApi(frontend, servicer.stream), metrics.exposition,
                         readiness.report)
        if keys.enabled:
            app.add_middleware(ApiKeyMiddleware, keys=keys)
        http = HttpServer(app, config.server.host, config.http_port)
        await http.start()
    listen = config.server
    metrics_server = metrics.serve(listen.host, listen.metrics_port) if listen.metrics_port \
        else None
    discovery = asyncio.create_task(instances.run())
    health = asyncio.create_task(readiness.run())
    log.info("gateway serving %s on %s:%d (HTTP %s, metrics %s; registry %s, namespace %s)",
             frontend.model_name, listen.host, server.port, http.port if http else "off",
             listen.metrics_port or "off", config.registry.url, config.registry.namespace)
    try:
        await wait_for_signal()
    finally:
        stopping = time.monotonic()
        log.info("gateway stopping")
        stops = [server.stop(config.server.shutdown_grace_s)]
        if http is not None:
            stops.append(http.stop(config.server.shutdown_grace_s))
        await asyncio.gather(*stops)
        await resumable.close()
        if metrics_server is not None:
            metrics_server.close()
        discovery.cancel()
        health.cancel()
        await asyncio.gather(discovery, health, return_exceptions=True)
        tracing.shutdown()
        await instances.close()
        if express is not None:
            express.close()
        registry.close()
        log.info("gateway stopped in %.1f s", time.monotonic() - stopping)
