"""Resumable client streams through a running stack: a client whose connection drops reconnects
with (request id, tokens received) and gets exactly the rest; a request nobody comes back for is
cancelled after the retention window and its blocks are freed."""

from __future__ import annotations

import grpc
import pytest

from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.cluster import Cluster, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RETENTION_S = 2.0
MAX_TOKENS = 150


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("resume-logs"), "dummy:tiny-llama", num_prefill=1,
                num_decode=1, engine_flags=["--device", "cpu", "--num-kv-blocks", "256"],
                gateway_flags=["--resume-retention-s", str(RETENTION_S)])
    try:
        c.wait_ready(timeout_s=120)
        yield c
    finally:
        c.close()


def request(request_id: str, resumable: bool = True) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(
        request_id=request_id, resumable=resumable,
        prompt_token_ids=generation_pb2.TokenIds(ids=[11, 12, 13, 14, 15]),
        params=types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


def resume(request_id: str, received: int) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(
        request_id=request_id, resume=generation_pb2.Resume(num_tokens_received=received))


def tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def first_tokens(cluster: Cluster, req: generation_pb2.GenerateStreamRequest, n: int) -> list[int]:
    """Read at least n tokens, then drop the connection."""
    call = cluster.stub.GenerateStream(req, timeout=60)
    got: list[int] = []
    for msg in call:
        got.extend(msg.token_ids)
        if len(got) >= n:
            break
    call.cancel()
    return got


def test_reconnect_gets_exactly_the_rest(cluster):
    want = tokens(cluster.stub.GenerateStream(request("plain", resumable=False), timeout=60))
    assert len(want) == MAX_TOKENS
    head = first_tokens(cluster, request("res-1"), 10)
    rest = list(cluster.stub.GenerateStream(resume("res-1", len(head)), timeout=60))
    assert head + tokens(rest) == want
    final = rest[-1]
    assert final.finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == MAX_TOKENS
    # Within the window, a late reconnect from any message boundary gets the tail again.
    again = list(cluster.stub.GenerateStream(resume("res-1", len(head)), timeout=60))
    assert tokens(again) == tokens(rest)
    assert cluster.wait_idle(timeout_s=10) == {}


def test_refusals(cluster):
    cases = [(request(""), grpc.StatusCode.INVALID_ARGUMENT,
              "a resumable request needs a request_id to reconnect with"),
             (resume("never-seen", 0), grpc.StatusCode.NOT_FOUND,
              "no resumable request 'never-seen' is retained")]
    for req, code, text in cases:
        with pytest.raises(grpc.RpcError) as err:
            list(cluster.stub.GenerateStream(req, timeout=10))
        assert err.value.code() == code and text in err.value.details()


def test_abandoned_request_is_cancelled_and_its_blocks_freed(cluster):
    head = first_tokens(cluster, request("res-2"), 3)
    assert len(head) >= 3
    # Still generating without a client: it holds decode blocks...
    wait_until("the detached request generating", lambda: any(
        s.num_used_blocks for s in cluster.stats().values() if s.role == "decode"), 10)
    # ...until the retention window passes with nobody back.
    assert cluster.wait_idle(timeout_s=RETENTION_S + 10) == {}

    def forgotten() -> bool:
        try:
            list(cluster.stub.GenerateStream(resume("res-2", len(head)), timeout=10))
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.NOT_FOUND
        return False

    wait_until("the abandoned request forgotten", forgotten, RETENTION_S + 5, interval_s=0.2)


def test_abort_cancels_a_detached_request(cluster):
    first_tokens(cluster, request("res-3"), 3)
    assert cluster.stub.Abort(types_pb2.AbortRequest(request_id="res-3"), timeout=5).found
    assert cluster.wait_idle(timeout_s=5) == {}
    rest = list(cluster.stub.GenerateStream(resume("res-3", 0), timeout=10))
    assert rest[-1].finish_reason == types_pb2.FINISH_REASON_ABORT
