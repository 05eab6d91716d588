"""The express lane through real processes (common/serving/express.py): requests start on the
prefill service by datagram and their Prefill calls adopt the work, and the decode streams'
first messages come back by datagram too, with the same tokens as a gateway without the lane; and a datagram never followed by its call (the gateway died between
the two), one whose request is aborted first, or one that comes after its call, strands no
block and runs nothing twice."""

from __future__ import annotations

import socket
import time
import urllib.request

import grpc
import pytest

from common.registry.embedded import free_port
from common.serving.express import listen_name
from protos.splitserve.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    types_pb2,
)
from splitserve.launch import service_argv
from tests.cluster import Cluster, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "dummy:tiny-llama"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                "--cpu-threads", "1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    metrics_port, decode_metrics_port = free_port(), free_port()
    c = Cluster(tmp_path_factory.mktemp("express-logs"), MODEL, num_prefill=1, num_decode=1,
                engine_flags=ENGINE_FLAGS, prefill_flags=["--metrics-port", str(metrics_port)],
                decode_flags=["--metrics-port", str(decode_metrics_port)])
    c.prefill_metrics_port = metrics_port
    c.decode_metrics_port = decode_metrics_port
    try:
        c.wait_ready(120)
        yield c
    finally:
        c.close()


def counted(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def express_starts(cluster: Cluster) -> float:
    return counted(cluster.prefill_metrics_port, "splitserve_prefill_express_starts_total")


def express_replies(cluster: Cluster) -> float:
    """Decode streams whose first message also went to the gateway as a datagram."""
    return counted(cluster.decode_metrics_port, "splitserve_decode_express_replies_total")


def request(i: int, max_tokens: int = 12) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=[3 + (11 * j + i) % 400 for j in range(40)]),
        params=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def prefill_address(cluster: Cluster) -> str:
    (info,) = cluster.registry.list_instances("prefill")
    return info.address


def prefill_request(cluster: Cluster, rid: str, max_tokens: int = 4,
                    prompt: int = 7) -> prefill_pb2.PrefillRequest:
    (decode,) = cluster.registry.list_instances("decode")
    return prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=list(request(prompt).prompt_token_ids.ids),
        params=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                        ignore_eos=True),
        decode_instance_id=decode.instance_id, decode_address=decode.address)


def express(cluster: Cluster, rid: str, timeout_s: float, max_tokens: int = 4,
            prompt: int = 7) -> socket.socket:
    """Send an ExpressPrefill for rid to the prefill service, as a gateway would; the socket
    the reply comes to."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(f"\0splitserve-test-express/{rid}".encode())
    sock.settimeout(10)
    sock.sendto(prefill_pb2.ExpressPrefill(
        request=prefill_request(cluster, rid, max_tokens, prompt), timeout_s=timeout_s,
    ).SerializeToString(), listen_name(prefill_address(cluster)))
    return sock


def first_tokens(cluster: Cluster, request: prefill_pb2.PrefillRequest) -> list[int]:
    """The first token of each message of a Prefill call (one message: max_tokens=1)."""
    with grpc.insecure_channel(prefill_address(cluster)) as channel:
        return [m.first_token_id for m in prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(
            request, timeout=30)]


def test_requests_take_the_lane_with_the_tokens_of_a_gateway_without_it(cluster):
    before, replies = express_starts(cluster), express_replies(cluster)
    fast = [list(cluster.stub.Generate(request(i), timeout=60).token_ids) for i in range(3)]
    first_token_only = cluster.stub.Generate(request(3, max_tokens=1), timeout=60)
    assert express_starts(cluster) - before == 4
    # The decode streams' first messages (the second tokens) came by datagram as well; the
    # request that ended at its first token never reached the decode engine.
    assert express_replies(cluster) - replies == 3
    port = free_port()
    cluster._launch("gateway-plain", service_argv(
        "gateway", registry_url=cluster.redis.url, namespace=cluster.namespace, port=port,
        model=MODEL, extra=["--no-express"]))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        wait_until("the second gateway", lambda: stub.ModelInfo(
            generation_pb2.ModelInfoRequest(), timeout=2).num_prefill_instances, 60)
        plain = [list(stub.Generate(request(i), timeout=60).token_ids) for i in range(3)]
        assert stub.Generate(request(3, max_tokens=1), timeout=60).token_ids == \
            first_token_only.token_ids
    assert express_starts(cluster) - before == 4  # the second gateway sent none
    assert express_replies(cluster) - replies == 3  # nor asked for any
    assert fast == plain and all(len(t) == 12 for t in fast)
    # The request that ended at its first token: its call was read to its end, so the prefill
    # service released the prompt's blocks at once (not when the express start expired).
    assert cluster.wait_idle(5) == {}


def test_a_start_no_call_adopts_is_aborted(cluster):
    sock = express(cluster, "orphan-1", timeout_s=1.0)
    reply = prefill_pb2.PrefillResponse.FromString(sock.recv(1 << 16))  # from the engine thread
    sock.close()
    assert reply.request_id == "orphan-1" and reply.queue_ms >= 0 and not reply.finish_reason
    assert cluster.stats()[cluster.instance_ids["prefill-0"]].num_used_blocks > 0  # held
    assert cluster.wait_idle(15) == {}
    assert "orphan-1: started by the express lane, but no Prefill call came" in \
        cluster.logs(["prefill-0"])


def test_an_abort_before_the_call_frees_the_start(cluster):
    express(cluster, "aborted-1", timeout_s=60.0).close()
    with grpc.insecure_channel(prefill_address(cluster)) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        wait_until("the express start", lambda: cluster.stats()[
            cluster.instance_ids["prefill-0"]].num_used_blocks, 10)
        stub.Abort(prefill_pb2.PrefillServiceAbortRequest(request_id="aborted-1"), timeout=10)
    assert cluster.wait_idle(5) == {}  # well before its 60 s


def test_a_call_with_another_request_than_its_datagram_starts_its_own(cluster):
    express(cluster, "mismatch-1", timeout_s=60.0, max_tokens=1, prompt=7).close()
    wait_until("the express start", lambda: cluster.stats()[
        cluster.instance_ids["prefill-0"]].num_used_blocks, 10)
    got = first_tokens(cluster, prefill_request(cluster, "mismatch-1", max_tokens=1, prompt=9))
    assert len(got) == 1 and got == first_tokens(
        cluster, prefill_request(cluster, "direct-9", max_tokens=1, prompt=9))
    assert got != first_tokens(cluster, prefill_request(cluster, "direct-7", max_tokens=1,
                                                        prompt=7))  # prompt 7 differs
    assert "mismatch-1: started by the express lane, but its Prefill call carried another " \
        "request" in cluster.logs(["prefill-0"])
    assert cluster.wait_idle(5) == {}


def test_a_datagram_after_its_call_is_dropped(cluster):
    with grpc.insecure_channel(prefill_address(cluster)) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        messages = list(stub.Prefill(prefill_request(cluster, "late-1", max_tokens=1),
                                     timeout=30))
    assert len(messages) == 1 and messages[0].finish_reason
    sock = express(cluster, "late-1", timeout_s=0.5, max_tokens=1)
    sock.settimeout(1.5)
    with pytest.raises(TimeoutError):  # nothing ran: no reply
        sock.recv(1 << 16)
    sock.close()
    assert cluster.wait_idle(5) == {}
    time.sleep(0.5)
    assert "late-1: started by the express lane" not in cluster.logs(["prefill-0"])
