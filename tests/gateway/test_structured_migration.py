"""A JSON-schema stream whose decode service is SIGKILLed mid-stream (issue 24): the gateway
resumes it on the other decode service with the tokens already streamed as outputs, that service
rebuilds the grammar's matcher from them, and the whole output still validates against the
schema. Real processes, the real SmolLM2 model, one prefill and two decode services."""

from __future__ import annotations

import json

import jsonschema
import pytest

from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.cluster import DECODE_FLAGS, GATEWAY_FLAGS, PREFILL_FLAGS, Cluster, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
ENGINE_FLAGS = ["--num-kv-blocks", "256", "--cpu-threads", "1"]
# Long enough (about 120 tokens) that the kill lands mid-stream.
SCHEMA = {"type": "array", "minItems": 40, "maxItems": 40,
          "items": {"type": "integer", "minimum": 0, "maximum": 999}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("structured-migration"), MODEL, num_prefill=1,
                num_decode=2, engine_flags=ENGINE_FLAGS, prefill_flags=PREFILL_FLAGS,
                decode_flags=DECODE_FLAGS, gateway_flags=GATEWAY_FLAGS)
    try:
        c.wait_ready(300)
        yield c
    finally:
        c.close()


def busy_decode(cluster: Cluster) -> str | None:
    """The slot of the decode service running a request, if one is."""
    by_id = {i: s for s, i in cluster.instance_ids.items()}
    for instance, s in cluster.stats().items():
        if s.role == "decode" and s.num_running:
            return by_id.get(instance)
    return None


def test_killed_decode_mid_stream_output_still_validates(cluster: Cluster):
    request = generation_pb2.GenerateStreamRequest(
        request_id="structured-migrate", prompt="Forty numbers as a JSON array:",
        params=types_pb2.SamplingParams(max_tokens=400, temperature=0.0,
                                        json_schema=json.dumps(SCHEMA)))
    tokens, text, killed, final = [], "", None, None
    for msg in cluster.stub.GenerateStream(request, timeout=300):
        tokens.extend(msg.token_ids)
        text += msg.text
        if killed is None and len(tokens) >= 10:
            killed = wait_until("a decode running the request", lambda: busy_decode(cluster),
                                30)
            cluster.kill(killed)
        if msg.finish_reason:
            final = msg
    assert killed is not None and final is not None
    assert final.finish_reason == types_pb2.FINISH_REASON_STOP
    assert final.timings.num_migrations >= 1
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    assert len(value) == 40


def test_killed_decode_mid_stream_of_n_choices_is_unavailable(cluster: Cluster):
    """n > 1 is not migrated once tokens went out (docs/ARCHITECTURE.md): the client gets
    UNAVAILABLE saying so, and retries. Runs last: it kills the last spare decode service."""
    import grpc
    request = generation_pb2.GenerateStreamRequest(
        request_id="choices-migrate", prompt="Count to a thousand:",
        params=types_pb2.SamplingParams(max_tokens=300, temperature=0.8, seed=5, n=2,
                                        ignore_eos=True))
    received, killed = 0, None
    with pytest.raises(grpc.RpcError) as err:
        for msg in cluster.stub.GenerateStream(request, timeout=300):
            received += len(msg.token_ids)
            if killed is None and received >= 10:
                killed = wait_until("a decode running the request",
                                    lambda: busy_decode(cluster), 30)
                cluster.kill(killed)
    assert killed is not None
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "n=2 is not migrated after its first tokens" in err.value.details()
