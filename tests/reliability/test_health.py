"""Readiness that tells the truth, on real processes: the gateway's /health and gRPC health
follow the registered instances (none, both kinds, every decode instance SIGKILLed, one back),
a request sent the moment /health says 200 is served, and a decode service reports NOT_SERVING
(and /health 503 beside /metrics) from the moment it starts draining."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.cluster import Cluster, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "dummy:tiny-llama"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                "--cpu-threads", "1"]
TTL_S = 1.5
SERVICE_FLAGS = ["--heartbeat-ttl-s", str(TTL_S)]
GENERATION = "splitserve.v1.GenerationService"


def http_health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def grpc_health(address: str, service: str = "") -> str:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def health_command(*args: str) -> tuple[int, str]:
    """`splitserve health ...` as a user runs it; its exit code and its line."""
    done = subprocess.run([sys.executable, "-m", "splitserve.cli", "health", *args],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout.strip()


def request(max_tokens: int = 8) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=[5, 6, 7, 8, 9]),
        params=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    http_port = free_port()
    c = Cluster(tmp_path_factory.mktemp("health-logs"), MODEL, num_prefill=0, num_decode=0,
                engine_flags=ENGINE_FLAGS, prefill_flags=SERVICE_FLAGS,
                decode_flags=SERVICE_FLAGS,
                gateway_flags=["--http-port", str(http_port), "--discovery-interval-s", "0.1"])
    c.health_url = f"http://127.0.0.1:{http_port}/health"
    c.address = f"127.0.0.1:{c.gateway_port}"
    try:
        yield c
    finally:
        c.close()


def add(cluster: Cluster, slot: str, *extra: str) -> str:
    role = slot.split("-")[0]
    if slot not in cluster.slots:
        cluster.slots.append(slot)
    flags = cluster.role_flags[role]
    cluster.role_flags[role] = [*flags, *extra]
    try:
        return cluster.start(slot)
    finally:
        cluster.role_flags[role] = flags


def test_gateway_readiness_follows_the_instances(cluster):
    wait_until("the gateway's HTTP server", lambda: http_health(
        cluster.health_url.replace("/health", "/health/live"))[0] == 200, 60)
    status, body = http_health(cluster.health_url)
    assert (status, body["status"], body["missing"]) == (503, "not ready", ["prefill", "decode"])
    assert grpc_health(cluster.address) == "NOT_SERVING"
    assert grpc_health(cluster.address, GENERATION) == "NOT_SERVING"
    assert health_command(cluster.address)[0] == 1
    assert health_command("--http", cluster.health_url)[0] == 1

    add(cluster, "prefill-0")
    wait_until("prefill registered", lambda: http_health(cluster.health_url)[1]["missing"]
               == ["decode"], 120)
    assert http_health(cluster.health_url)[0] == 503
    add(cluster, "decode-0")
    wait_until("/health 200", lambda: http_health(cluster.health_url)[0] == 200, 120,
               interval_s=0.02)
    # The moment it says ready, a request is served (never "no decode instance").
    tokens = [t for msg in cluster.stub.GenerateStream(request(), timeout=60)
              for t in msg.token_ids]
    assert len(tokens) == 8
    assert http_health(cluster.health_url)[1] == {
        "status": "ready", "missing": [], "instances": {"prefill": 1, "decode": 1}}
    assert grpc_health(cluster.address) == grpc_health(cluster.address, GENERATION) == "SERVING"
    code, line = health_command(cluster.address, "--service", GENERATION)
    assert (code, line) == (0, f"{cluster.address} ({GENERATION}): SERVING")

    killed = time.monotonic()
    cluster.kill("decode-0")
    wait_until("/health 503 after the decode kill", lambda: http_health(cluster.health_url)[0]
               == 503, 3 * TTL_S)
    assert time.monotonic() - killed < TTL_S + 1.0  # the record's TTL plus a discovery round
    assert http_health(cluster.health_url)[1]["missing"] == ["decode"]
    assert grpc_health(cluster.address) == "NOT_SERVING"
    assert health_command(cluster.address)[0] == 1

    add(cluster, "decode-0")
    wait_until("/health 200 again", lambda: http_health(cluster.health_url)[0] == 200, 120)
    assert grpc_health(cluster.address, GENERATION) == "SERVING"
    assert health_command("--http", cluster.health_url)[0] == 0


def test_a_service_reports_not_serving_while_it_drains(cluster):
    metrics_port = free_port()
    instance_id = add(cluster, "decode-1", "--metrics-port", str(metrics_port),
                      "--shutdown-grace-s", "30")
    wait_until("decode-1 registered", lambda: instance_id in cluster.registered(), 120)
    address = next(i.address for i in cluster.registry.list_instances("decode")
                   if i.instance_id == instance_id)
    url = f"http://127.0.0.1:{metrics_port}/health"
    wait_until("decode-1 SERVING", lambda: grpc_health(address) == "SERVING", 30)
    assert http_health(url) == (200, {"status": "ready", "kind": "decode",
                                      "instance_id": instance_id})
    assert health_command(address)[0] == 0

    # Leave decode-1 the only decode instance, so the open stream is its own.
    cluster.kill("decode-0")
    wait_until("decode-0 gone", lambda: cluster.instance_ids["decode-0"]
               not in cluster.registered(), 3 * TTL_S)
    wait_until("the gateway sees decode-1 alone", lambda: http_health(cluster.health_url)[1][
        "instances"]["decode"] == 1, 5)
    received: list[int] = []
    errors: list[grpc.RpcError] = []

    def stream() -> None:
        try:
            for msg in cluster.stub.GenerateStream(request(max_tokens=1500), timeout=120):
                received.extend(msg.token_ids)
        except grpc.RpcError as e:
            errors.append(e)

    thread = threading.Thread(target=stream)
    thread.start()
    wait_until("the stream under way", lambda: len(received) >= 3, 60)
    cluster.procs["decode-1"].terminate()  # SIGTERM: drain with a 30 s grace
    status, body = wait_until("/health 503 while draining", lambda: (
        (r := http_health(url))[0] == 503 and r), 10)
    assert body["status"] == "not ready"
    assert len(received) < 1500 and cluster.procs["decode-1"].poll() is None  # still streaming
    try:
        assert grpc_health(address) == "NOT_SERVING"
    except grpc.RpcError as e:  # the server refuses new calls once its grace period began
        assert e.code() == grpc.StatusCode.UNAVAILABLE
    assert health_command(address)[0] == 1
    thread.join(timeout=120)
    assert not errors and len(received) == 1500
    assert cluster.procs["decode-1"].wait(timeout=30) == 0
