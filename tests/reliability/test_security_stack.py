"""The whole stack with TLS everywhere, mTLS between the services and an API key on the gateway:
what gets through and what is refused, with the status each refusal gets."""

from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.request

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.registry.embedded import free_port
from common.serving.auth import MISSING, WRONG, bearer_metadata
from common.serving.instance import InstanceConfig
from common.serving.tls import PLAINTEXT, TlsConfig, sync_channel
from gateway.config import GatewayConfig
from protos.splitserve.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    types_pb2,
)
from tests.certs import make_ca, make_leaf
from tests.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "sk-splitserve-test"
ENGINE_FLAGS = ["--device", "cpu", "--num-kv-blocks", "128"]
REQUEST = generation_pb2.GenerateRequest(
    prompt_token_ids=generation_pb2.TokenIds(ids=[5, 6, 7, 8]),
    params=types_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
STREAM_REQUEST = generation_pb2.GenerateStreamRequest.FromString(REQUEST.SerializeToString())


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "ca")
    leaves = {name: make_leaf(d, name, ca)
              for name in ("prefill", "decode", "gateway", "operator")}
    (d / "keys").write_text(f"# gateway keys\n{KEY}\n")
    http_port = free_port()

    def flags(name: str, client_auth: bool) -> list[str]:
        return leaves[name].tls(ca, client_auth=client_auth).to_argv()

    cluster = Cluster(
        tmp_path_factory.mktemp("secure-logs"), "dummy:tiny-llama", num_prefill=1, num_decode=1,
        engine_flags=ENGINE_FLAGS, prefill_flags=flags("prefill", True),
        decode_flags=flags("decode", True),
        # The public port serves TLS without client certificates: the API key authenticates.
        gateway_flags=[*flags("gateway", False), "--api-key-file", str(d / "keys"),
                       "--http-port", str(http_port)],
        client_tls=TlsConfig(tls_ca=str(ca.cert_path)),
        internal_tls=leaves["operator"].tls(ca), api_key=KEY)
    try:
        cluster.wait_ready(timeout_s=120)
        cluster.http_port = http_port
        yield cluster, ca, d
    finally:
        cluster.close()


def test_authenticated_clients_get_answers(secure):
    cluster, _, _ = secure
    out = cluster.stub.Generate(REQUEST, timeout=30, metadata=bearer_metadata(KEY))
    assert len(out.token_ids) == 6 and out.finish_reason == types_pb2.FINISH_REASON_LENGTH
    # The gateway reached both services over mTLS, and the test reaches them with its own cert.
    assert {s.role for s in cluster.stats().values()} == {"prefill", "decode"}


def test_missing_or_wrong_key_is_unauthenticated(secure):
    cluster, _, _ = secure
    for metadata, why in (((), MISSING), (bearer_metadata("sk-wrong"), WRONG)):
        with pytest.raises(grpc.RpcError) as err:
            list(cluster.stub.GenerateStream(STREAM_REQUEST, timeout=10, metadata=metadata))
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, why)
        with pytest.raises(grpc.RpcError) as err:
            cluster.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10,
                                   metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Health stays open for probes.
    health = health_pb2_grpc.HealthStub(cluster.channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_and_unverified_clients_are_refused(secure):
    cluster, ca, d = secure
    gateway = f"127.0.0.1:{cluster.gateway_port}"
    rogue_ca = make_ca(d, "rogue-ca")
    for tls in (PLAINTEXT, TlsConfig(tls_ca=str(rogue_ca.cert_path))):
        with sync_channel(gateway, tls) as channel, pytest.raises(grpc.RpcError) as err:
            generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                REQUEST, timeout=3, metadata=bearer_metadata(KEY))
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED)
    # The services take no caller without a certificate from the stack's CA.
    prefill = cluster.registry.list_instances("prefill")[0].address
    rogue = make_leaf(d, "rogue", rogue_ca)
    callers = (PLAINTEXT, TlsConfig(tls_ca=str(ca.cert_path)),
               TlsConfig(tls_cert=str(rogue.cert_path), tls_key=str(rogue.key_path),
                         tls_ca=str(ca.cert_path)))
    for tls in callers:
        with sync_channel(prefill, tls) as channel, pytest.raises(grpc.RpcError) as err:
            prefill_pb2_grpc.PrefillServiceStub(channel).Stats(
                prefill_pb2.PrefillServiceStatsRequest(), timeout=3)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED)


def test_http_api_key(secure):
    cluster, _, _ = secure
    url = f"http://127.0.0.1:{cluster.http_port}"
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3}).encode()

    def post(headers: dict[str, str]) -> tuple[int, dict]:
        req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                     headers={"content-type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert post({}) == (401, {"error": {"message": MISSING, "type": "authentication_error",
                                        "param": None, "code": 401}})
    assert post({"authorization": "Bearer nope"})[0] == 401
    status, answer = post({"authorization": f"Bearer {KEY}"})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    for probe in ("/health", "/health/live"):  # probes need no key
        with urllib.request.urlopen(f"{url}{probe}", timeout=5) as r:
            assert r.status == 200


def test_everything_listens_on_loopback_only(secure):
    cluster, _, _ = secure
    assert InstanceConfig().server.host == GatewayConfig().server.host == "127.0.0.1"
    pids = [p.pid for p in cluster.procs.values()] + [cluster.redis.pid]
    listening = [(pid, c.laddr.ip) for pid in pids
                 for c in psutil.Process(pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert {pid for pid, _ in listening} == set(pids)

    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip)
        mapped = getattr(address, "ipv4_mapped", None)  # gRPC's ::ffff:127.0.0.1
        return (mapped or address).is_loopback

    assert all(loopback(ip) for _, ip in listening), listening
