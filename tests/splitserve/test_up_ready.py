"""Readiness through `splitserve up`, as a script or a probe meets it: /health is polled from the
moment `up` starts; it answers 503 (saying what is missing) while the services load, and the
moment it answers 200 a request over HTTP and one over gRPC are both served (never 503, never
"no decode instance")."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from tests.cluster import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "dummy:tiny-llama"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                "--cpu-threads", "1"]


def get(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_health_says_ready_only_when_a_request_is_served(tmp_path):
    grpc_port, http_port = free_port(), free_port()
    base = f"http://127.0.0.1:{http_port}"
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "up", "--grpc-port", str(grpc_port),
             "--http-port", str(http_port), "--model", MODEL, *ENGINE_FLAGS],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    seen: list[int] = []
    try:
        def ready() -> bool:
            assert up.poll() is None, log_path.read_text()
            try:
                status, body = get(f"{base}/health")
            except OSError:  # the gateway's HTTP server is not up yet
                return False
            seen.append(status)
            if status == 503:
                assert body["status"] == "not ready" and body["missing"], body
            return status == 200
        wait_until("/health 200", ready, 180, interval_s=0.02)
        # The moment it says 200: served over HTTP and over gRPC.
        status, answer = get(f"{base}/v1/completions", {
            "model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 6
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            tokens = [t for msg in stub.GenerateStream(generation_pb2.GenerateStreamRequest(
                prompt_token_ids=generation_pb2.TokenIds(ids=[5, 6, 7, 8]),
                params=types_pb2.SamplingParams(max_tokens=6, temperature=0.0,
                                                ignore_eos=True)), timeout=60)
                      for t in msg.token_ids]
        assert len(tokens) == 6
        assert 503 in seen, seen  # it was polled while the services loaded
        assert get(f"{base}/health/live")[0] == 200
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        code = up.wait(60)
    assert code == 0, log_path.read_text()[-3000:]
