"""The gateway's readiness rule and its gRPC health, over a real registry (Redis) and a real
grpc.aio server: ready only with a usable prefill and decode instance; an instance in quarantine
or whose record expired does not count."""

from __future__ import annotations

import asyncio
import time

from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.registry import InstanceInfo, Registry
from common.serving.grpc_util import GrpcServer, insecure_channel
from gateway.instances import Instances
from gateway.quarantine import Quarantine
from gateway.readiness import Readiness, missing_kinds


def info(instance_id: str, kind: str) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, kind=kind, address="127.0.0.1:1", model="m")


def test_missing_kinds():
    p, d = info("p", "prefill"), info("d", "decode")
    assert missing_kinds({}) == ["prefill", "decode"]
    assert missing_kinds({"prefill": [p], "decode": []}) == ["decode"]
    assert missing_kinds({"decode": [d]}) == ["prefill"]
    assert missing_kinds({"prefill": [p], "decode": [d]}) == []


async def _health(port: int, service: str = "") -> str:
    async with insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_readiness_follows_registry_and_quarantine(registry: Registry):
    async def scenario() -> None:
        now = [0.0]
        quarantine = Quarantine(5.0, clock=lambda: now[0])
        instances = Instances(registry, 0.1, quarantine=quarantine)
        server = GrpcServer("127.0.0.1", 0)
        server.service_names.append("splitserve.v1.GenerationService")
        readiness = Readiness(instances, server)
        await server.start(serving=False)
        try:
            assert await _health(server.port) == "NOT_SERVING"
            await instances.refresh()
            assert not await readiness.update()
            assert readiness.report() == {"status": "not ready",
                                          "missing": ["prefill", "decode"],
                                          "instances": {"prefill": 0, "decode": 0}}
            registry.register(info("p0", "prefill"), ttl_s=30)
            registry.register(info("d0", "decode"), ttl_s=0.5)
            # A read of the registry, whoever asks for it (here a request's), updates the health
            # at once: a request that found both instances never meets a NOT_SERVING probe.
            assert await instances.get("decode")
            assert readiness.ready and readiness.report()["status"] == "ready"
            for service in ("", "splitserve.v1.GenerationService"):
                assert await _health(server.port, service) == "SERVING"

            quarantine.add("p0")  # its call failed and it did not answer a health check
            assert not await readiness.update()
            assert readiness.report()["missing"] == ["prefill"]
            assert await _health(server.port) == "NOT_SERVING"
            now[0] += 5.0  # the quarantine ran out
            assert await readiness.update()

            time.sleep(0.6)  # d0's record expires (its heartbeat stopped)
            await instances.refresh()
            assert not await readiness.update()
            assert readiness.report()["missing"] == ["decode"]
            assert await _health(server.port, "splitserve.v1.GenerationService") == "NOT_SERVING"
        finally:
            await server.stop(0)
            await instances.close()

    asyncio.run(scenario())
