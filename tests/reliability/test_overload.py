"""Overload: a burst of ten times the gateway's capacity (--max-inflight) gets RESOURCE_EXHAUSTED
at once for the excess, and the admitted requests complete."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CAPACITY = 4
MAX_TOKENS = 200  # long enough that no admitted request ends during the burst


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    http_port = free_port()
    c = Cluster(tmp_path_factory.mktemp("overload-logs"), "dummy:tiny-llama", num_prefill=1,
                num_decode=1, engine_flags=["--device", "cpu", "--num-kv-blocks", "512"],
                gateway_flags=["--max-inflight", str(CAPACITY), "--http-port", str(http_port)])
    c.http_port = http_port
    try:
        c.wait_ready(timeout_s=120)
        yield c
    finally:
        c.close()


def test_grpc_burst_of_ten_times_capacity(cluster):
    barrier = threading.Barrier(10 * CAPACITY)

    def one(i: int) -> tuple[str, float, int]:
        req = generation_pb2.GenerateStreamRequest(
            request_id=f"burst-{i}", prompt_token_ids=generation_pb2.TokenIds(ids=[5 + i, 6, 7]),
            params=types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                            ignore_eos=True))
        barrier.wait()
        start = time.monotonic()
        tokens = 0
        try:
            for msg in cluster.stub.GenerateStream(req, timeout=120):
                tokens += len(msg.token_ids)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert "limit of 4 requests" in e.details()
            return "refused", time.monotonic() - start, tokens
        return "served", time.monotonic() - start, tokens

    with ThreadPoolExecutor(10 * CAPACITY) as pool:
        results = list(pool.map(one, range(10 * CAPACITY)))
    served = [r for r in results if r[0] == "served"]
    refused = [r for r in results if r[0] == "refused"]
    print(f"served {len(served)}, refused {len(refused)}; slowest refusal "
          f"{max(r[1] for r in refused):.3f} s")
    assert 1 <= len(served) <= CAPACITY and len(served) + len(refused) == 10 * CAPACITY
    assert all(r[2] == MAX_TOKENS for r in served)
    assert max(r[1] for r in refused) < 2.0  # refused at admission, not after queueing
    assert cluster.wait_idle(timeout_s=10) == {}


def test_http_burst_of_ten_times_capacity(cluster):
    barrier = threading.Barrier(10 * CAPACITY)
    url = f"http://127.0.0.1:{cluster.http_port}/v1/completions"

    def one(i: int) -> tuple[int, float, dict]:
        body = json.dumps({"prompt": [5 + i, 6, 7], "max_tokens": MAX_TOKENS,
                           "temperature": 0.0, "ignore_eos": True}).encode()
        req = urllib.request.Request(url, data=body, method="POST",
                                     headers={"content-type": "application/json"})
        barrier.wait()
        start = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, time.monotonic() - start, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, time.monotonic() - start, json.loads(e.read())

    with ThreadPoolExecutor(10 * CAPACITY) as pool:
        results = list(pool.map(one, range(10 * CAPACITY)))
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    print(f"HTTP: served {len(served)}, refused {len(refused)}; slowest refusal "
          f"{max(r[1] for r in refused):.3f} s")
    assert 1 <= len(served) <= CAPACITY
    assert {r[0] for r in refused} == {429}
    assert all(r[2]["error"]["type"] == "rate_limit_error" for r in refused)
    assert all(r[2]["usage"]["completion_tokens"] == MAX_TOKENS for r in served)
    assert max(r[1] for r in refused) < 2.0
    assert cluster.wait_idle(timeout_s=10) == {}
