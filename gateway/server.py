"""Runs the gateway: tokenizer and model metadata, registry view, router, public gRPC server."""

from __future__ import annotations

import asyncio
import logging
import time

from common.grpc_util import GrpcServer, Service, service_name, wait_for_signal
from common.registry import BlockRegistry
from common.tokenizer import Tokenizer
from gateway.config import GatewayConfig
from gateway.frontend import Frontend
from gateway.instances import Instances
from gateway.model_files import wait_for_model_files
from gateway.relay import Relay
from gateway.router import Router, RouterConfig
from gateway.servicer import GenerationServicer
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("splitserve.gateway")


def build_frontend(config: GatewayConfig) -> tuple[Frontend, tuple[int, ...]]:
    if config.model.startswith("dummy:"):
        return Frontend(config.model_name, None, 0, 0), ()
    files = wait_for_model_files(config.model, config.model_cache_dir, config.tokenizer,
                                 config.model_wait_s)
    tokenizer = Tokenizer.from_dir(files.directory)
    frontend = Frontend(config.model_name, tokenizer, files.max_model_len, files.vocab_size)
    return frontend, tokenizer.eos_token_ids


async def serve(config: GatewayConfig) -> None:
    registry = BlockRegistry(config.registry_url, config.registry_namespace)
    registry.ping()
    frontend, eos_token_ids = await asyncio.to_thread(build_frontend, config)
    instances = Instances(registry, config.discovery_interval_s)
    router = Router(RouterConfig(config.prefix_token_weight, config.queued_request_cost_tokens))
    relay = Relay(config, registry, instances, router)
    servicer = GenerationServicer(config, frontend, relay, instances, eos_token_ids)
    server = GrpcServer(config.host, config.grpc_port)
    server.add(Service(servicer, generation_pb2_grpc.add_GenerationServicer_to_server,
                       service_name(generation_pb2, "Generation")))
    await server.start()
    discovery = asyncio.create_task(instances.run())
    log.info("gateway serving %s on %s:%d (registry %s, namespace %s)", frontend.model_name,
             config.host, server.port, config.registry_url, config.registry_namespace)
    try:
        await wait_for_signal()
    finally:
        stopping = time.monotonic()
        log.info("gateway stopping")
        await server.stop(config.shutdown_grace_s)
        discovery.cancel()
        await asyncio.gather(discovery, return_exceptions=True)
        await instances.close()
        registry.close()
        log.info("gateway stopped in %.1f s", time.monotonic() - stopping)
