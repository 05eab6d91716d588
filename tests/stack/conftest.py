"""A whole stack for tests: a redis-server on a free port, prefill, decode and gateway processes
started with the command lines of splitserve.launch (the ones docker-compose.yml uses), shared by
the tests of a module (starting it takes a while on two cores)."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest

from common.registry import EmbeddedRedis, Registry
from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from splitserve.launch import service_argv, start_service, stop_services

# Small pools: four services and the reference engine share a 2-core, 24 GiB box. Short
# prefill chunks: an abort takes effect between engine steps.
ENGINE_FLAGS = ["--num-kv-blocks", "512", "--max-num-batched-tokens", "128", "--cpu-threads", "1"]


class Stack:
    def __init__(self, log_dir: Path, num_prefill: int = 2, num_decode: int = 2,
                 decode_flags: tuple[str, ...] = ()):
        self.log_dir = log_dir
        self.redis = EmbeddedRedis()
        self.namespace = f"test-{uuid.uuid4().hex[:8]}"
        self.registry = Registry(self.redis.url, self.namespace)
        self.procs: dict[str, subprocess.Popen] = {}
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.metrics_ports: dict[str, int] = {}  # service name -> its /metrics port
        for role, n in (("prefill", num_prefill), ("decode", num_decode)):
            for i in range(n):
                name = f"{role}-{i}"
                self.metrics_ports[name] = free_port()
                role_flags = decode_flags if role == "decode" else ()
                self.start(name, service_argv(
                    role, registry_url=self.redis.url, namespace=self.namespace,
                    metrics_port=self.metrics_ports[name],
                    extra=[*ENGINE_FLAGS, *role_flags, "--instance-id", name]))
        self.gateway_port, self.http_port = free_port(), free_port()
        self.metrics_ports["gateway"] = free_port()
        self.start("gateway", service_argv(
            "gateway", registry_url=self.redis.url, namespace=self.namespace,
            port=self.gateway_port, metrics_port=self.metrics_ports["gateway"],
            http_port=self.http_port))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.gateway_port}")
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    def gateway_argv(self, port: int, namespace: str | None = None,
                     extra: tuple[str, ...] = ()) -> list[str]:
        return service_argv("gateway", registry_url=self.redis.url,
                            namespace=namespace or self.namespace, port=port, extra=extra)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        self.procs[name] = start_service(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self.procs[name]

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited during start-up:\n{self.logs(dead)}")
            try:
                info = self.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=2.0)
                if (info.num_prefill_instances == self.num_prefill
                        and info.num_decode_instances == self.num_decode):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"stack not ready in {timeout_s} s:\n{self.logs(list(self.procs))}")

    def stats(self) -> dict[str, types_pb2.InstanceStats]:
        info = self.stub.ModelInfo(generation_pb2.ModelInfoRequest(include_instances=True),
                                   timeout=5.0)
        return {s.instance_id: s for s in info.instances}

    def wait_idle(self, timeout_s: float) -> float:
        """Seconds until no instance references a block (held for a delivery, reserved for one,
        or running) and none waits for a delivery."""
        start = time.monotonic()
        while True:
            stats = self.stats()
            busy = {i: s.num_used_blocks for i, s in stats.items() if s.num_used_blocks}
            handoffs = {i: s.num_pending_handoffs for i, s in stats.items()
                        if s.num_pending_handoffs}
            if not busy and not handoffs and len(stats) == self.num_prefill + self.num_decode:
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"still referenced blocks {busy}, handoffs {handoffs} "
                                     f"after {timeout_s} s")
            time.sleep(0.02)

    def logs(self, names: list[str]) -> str:
        return "\n".join(f"--- {n}\n" + (self.log_dir / f"{n}.log").read_text()[-4000:]
                         for n in names)

    def stop(self) -> dict[str, int]:
        self.channel.close()
        names = list(self.procs)
        codes = stop_services([self.procs[n] for n in names])
        return dict(zip(names, codes, strict=True))

    def close(self) -> None:
        self.stop()
        self.registry.close()
        self.redis.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    """One gateway, two prefill and two decode services on loopback."""
    s = Stack(tmp_path_factory.mktemp("stack-logs"))
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()
