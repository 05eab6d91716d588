"""A stack of real processes that a test can break: a redis-server it can kill and restart on the
same port, prefill and decode services it can SIGKILL and restart (each incarnation registers
under a new instance id, <slot>-g<n>), and one gateway, all on loopback, with the command lines of
splitserve.launch."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.registry import EmbeddedRedis, Registry
from common.registry.embedded import free_port
from common.serving.auth import bearer_metadata
from common.serving.tls import PLAINTEXT, TlsConfig, sync_channel
from protos.splitserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    types_pb2,
)
from splitserve.launch import service_argv, start_service, stop_services

# Flags that make failures show fast (short heartbeats, leases and discovery; a gateway that
# retries long enough to outlive a restart): the chaos and scale-down tests start services so.
LEASE_S = 3.0
SERVICE_FLAGS = ["--heartbeat-ttl-s", "1.5", "--stats-interval-s", "0.1"]
PREFILL_FLAGS = [*SERVICE_FLAGS, "--handoff-lease-s", str(LEASE_S)]
DECODE_FLAGS = [*SERVICE_FLAGS, "--pull-timeout-s", "5", "--peer-check-s", "0.2"]
GATEWAY_FLAGS = ["--discovery-interval-s", "0.1", "--request-timeout-s", "120",
                 "--max-retries", "4", "--retry-wait-s", "8", "--quarantine-s", "3"]


def wait_until(what: str, check: Callable[[], object], timeout_s: float,
               interval_s: float = 0.05) -> object:
    """Poll check() until it returns something truthy; its value. TimeoutError names `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except (grpc.RpcError, OSError, ConnectionError) as e:
            value, last = None, e
        else:
            last = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s (last error: {last})")
        time.sleep(interval_s)


class Cluster:
    def __init__(self, log_dir: Path, model: str, *, num_prefill: int = 2, num_decode: int = 2,
                 engine_flags: Sequence[str] = (), prefill_flags: Sequence[str] = (),
                 decode_flags: Sequence[str] = (), gateway_flags: Sequence[str] = (),
                 client_tls: TlsConfig = PLAINTEXT, internal_tls: TlsConfig = PLAINTEXT,
                 api_key: str | None = None):
        """client_tls: how the test dials the gateway; internal_tls: how it dials the services
        (their Stats); api_key: sent with the harness's own gateway calls."""
        self.log_dir = log_dir
        self.client_tls = client_tls
        self.internal_tls = internal_tls
        self.metadata = bearer_metadata(api_key)
        self.model = model
        self.engine_flags = list(engine_flags)
        self.role_flags = {"prefill": list(prefill_flags), "decode": list(decode_flags)}
        self.redis_port = free_port()
        self.redis = EmbeddedRedis(port=self.redis_port)
        self.namespace = f"chaos-{uuid.uuid4().hex[:8]}"
        self.registry = Registry(self.redis.url, self.namespace, timeout_s=1.0, retries=1)
        self.procs: dict[str, subprocess.Popen] = {}  # slot -> current incarnation
        self.instance_ids: dict[str, str] = {}
        self.generations: Counter[str] = Counter()
        self.all_pids: list[int] = []
        self.slots = [f"prefill-{i}" for i in range(num_prefill)] + [
            f"decode-{i}" for i in range(num_decode)]
        for slot in self.slots:
            self.start(slot)
        self.gateway_port = free_port()
        self._launch("gateway", service_argv(
            "gateway", registry_url=self.redis.url, namespace=self.namespace,
            port=self.gateway_port, model=model, extra=list(gateway_flags)))
        self.channel = sync_channel(f"127.0.0.1:{self.gateway_port}", client_tls)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    # ---- processes ------------------------------------------------------------------------------
    def _launch(self, slot: str, argv: list[str]) -> subprocess.Popen:
        with open(self.log_dir / f"{slot}.log", "ab") as log:
            proc = start_service(argv, stdout=log, stderr=subprocess.STDOUT)
        self.procs[slot] = proc
        self.all_pids.append(proc.pid)
        return proc

    def start(self, slot: str) -> str:
        """Start the slot's next incarnation; its instance id."""
        role = slot.split("-")[0]
        self.generations[slot] += 1
        instance_id = f"{slot}-g{self.generations[slot]}"
        self.instance_ids[slot] = instance_id
        self._launch(slot, service_argv(
            role, registry_url=self.redis.url, namespace=self.namespace, model=self.model,
            extra=[*self.engine_flags, *self.role_flags[role], "--instance-id", instance_id]))
        return instance_id

    def kill(self, slot: str) -> int:
        """SIGKILL the slot's process (a crash: no deregistration, no cleanup); its pid."""
        proc = self.procs[slot]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return proc.pid

    def freeze(self, slot: str) -> int:
        """SIGSTOP the slot's process (a hang: its sockets stay open, nothing answers)."""
        self.procs[slot].send_signal(signal.SIGSTOP)
        return self.procs[slot].pid

    def thaw(self, slot: str) -> None:
        """SIGCONT a frozen slot's process."""
        self.procs[slot].send_signal(signal.SIGCONT)

    def kill_redis(self) -> None:
        self.redis.kill()

    def restart_redis(self) -> None:
        self.redis.stop()
        self.redis = EmbeddedRedis(port=self.redis_port)

    def logs(self, slots: Sequence[str] | None = None) -> str:
        names = slots or [*self.slots, "gateway"]
        return "\n".join(f"--- {n}\n" + (self.log_dir / f"{n}.log").read_text()[-3000:]
                         for n in names)

    # ---- what the registry and the services say -------------------------------------------------
    def registered(self) -> set[str]:
        return {i.instance_id for kind in ("prefill", "decode")
                for i in self.registry.list_instances(kind)}

    def wait_ready(self, timeout_s: float) -> None:
        """Until every current incarnation is registered, the gateway sees them, and its gRPC
        health says SERVING (what a deployment's probe waits for)."""
        def ready() -> bool:
            dead = [s for s, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited:\n{self.logs(dead)}")
            if not set(self.instance_ids.values()) <= self.registered():
                return False
            info = self.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=2.0,
                                       metadata=self.metadata)
            n_prefill = sum(s.startswith("prefill") for s in self.slots)
            if (info.num_prefill_instances < n_prefill
                    or info.num_decode_instances < len(self.slots) - n_prefill):
                return False
            health = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0)
            return health.status == health_pb2.HealthCheckResponse.SERVING

        wait_until("the stack to come up", ready, timeout_s, interval_s=0.2)

    def stats(self) -> dict[str, types_pb2.InstanceStats]:
        """Stats of every registered instance, asked directly."""
        out = {}
        for kind, stub_cls, ask in (
                ("prefill", prefill_pb2_grpc.PrefillServiceStub,
                 prefill_pb2.PrefillServiceStatsRequest()),
                ("decode", decode_pb2_grpc.DecodeServiceStub,
                 decode_pb2.DecodeServiceStatsRequest())):
            for info in self.registry.list_instances(kind):
                with sync_channel(info.address, self.internal_tls) as channel:
                    out[info.instance_id] = stub_cls(channel).Stats(ask, timeout=2.0).stats
        return out

    def wait_idle(self, timeout_s: float) -> dict[str, int]:
        """Until no live instance references a block (held for a delivery, reserved for one, or
        running) and none waits for a delivery; the used blocks per instance (and pending
        deliveries) still there at the timeout (empty = none)."""
        leftovers: dict[str, int] = {}

        def idle() -> bool:
            nonlocal leftovers
            stats = self.stats()
            leftovers = {i: s.num_used_blocks for i, s in stats.items() if s.num_used_blocks}
            leftovers |= {f"{i} pending": s.num_pending_handoffs for i, s in stats.items()
                          if s.num_pending_handoffs}
            return not leftovers and set(self.instance_ids.values()) <= set(stats)

        try:
            wait_until("the stack to go idle", idle, timeout_s, interval_s=0.1)
        except TimeoutError:
            return leftovers
        return {}

    def stop(self) -> dict[str, int]:
        """SIGTERM everything (graceful shutdown); the exit codes by slot."""
        self.channel.close()
        names = list(self.procs)
        codes = stop_services([self.procs[n] for n in names])
        return dict(zip(names, codes, strict=True))

    def stale_shm_files(self) -> list[str]:
        return [f for f in os.listdir("/dev/shm")
                if f.startswith("splitserve-kv-") and int(f.split("-")[2]) in self.all_pids]

    def close(self) -> None:
        self.stop()
        for name in self.stale_shm_files():
            Path("/dev/shm", name).unlink(missing_ok=True)
        self.registry.close()
        self.redis.stop()
