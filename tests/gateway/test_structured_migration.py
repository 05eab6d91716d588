"""A JSON-schema stream whose decode service is SIGKILLed mid-stream (issue 24): the gateway
resumes it on the other decode service with the tokens already streamed as outputs, that service
rebuilds the grammar's matcher from them, and the whole output still validates against the
schema; the same with n = 2, each choice resumed as a request of its own. Real processes, the
real SmolLM2 model, one prefill and two decode services."""

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


def choices_of(cluster: Cluster, request: generation_pb2.GenerateStreamRequest,
               kill_after: int | None = None):
    """The stream's tokens and text per choice, its last message, and the slot killed once
    `kill_after` tokens arrived (None: undisturbed)."""
    tokens: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    finishes: dict[int, int] = {}
    killed, last = None, None
    for msg in cluster.stub.GenerateStream(request, timeout=300):
        tokens.setdefault(msg.index, []).extend(msg.token_ids)
        text[msg.index] = text.get(msg.index, "") + msg.text
        if msg.finish_reason:
            assert msg.index not in finishes, "a choice finished twice"
            finishes[msg.index] = msg.finish_reason
        if msg.HasField("usage"):
            last = msg
        if kill_after is not None and killed is None and sum(map(len, tokens.values())) >= (
                kill_after):
            killed = wait_until("a decode running the request", lambda: busy_decode(cluster),
                                30)
            cluster.kill(killed)
    return tokens, text, finishes, last, killed


def test_killed_decode_mid_stream_of_n_choices_resumes_each_choice(cluster: Cluster):
    """n = 2, seeded sampling under a JSON schema: the decode running both choices is killed
    mid-stream; each unfinished choice goes on as a request of its own (seed + index, its own
    delivered tokens), so both choices equal an undisturbed run's, token for token, and both
    still validate; usage counts every choice once. Runs last: it kills a decode service."""
    spare = next(s for s in cluster.slots if s.startswith("decode")
                 and cluster.procs[s].poll() is not None)  # the one the test above killed
    cluster.start(spare)
    cluster.wait_ready(300)

    def request(rid: str) -> generation_pb2.GenerateStreamRequest:
        return generation_pb2.GenerateStreamRequest(
            request_id=rid, prompt="Forty numbers as a JSON array:",
            params=types_pb2.SamplingParams(max_tokens=400, temperature=0.8, seed=5, n=2,
                                            json_schema=json.dumps(SCHEMA)))

    want, want_text, want_finish, _, _ = choices_of(cluster, request("choices-reference"))
    got, got_text, got_finish, last, killed = choices_of(cluster, request("choices-migrate"),
                                                         kill_after=20)
    assert killed is not None
    assert got == want and got_text == want_text
    assert got_finish == want_finish == {0: types_pb2.FINISH_REASON_STOP,
                                         1: types_pb2.FINISH_REASON_STOP}
    for i in (0, 1):
        jsonschema.validate(json.loads(got_text[i]), SCHEMA)
    assert last is not None and last.timings.num_migrations >= 1
    assert last.usage.completion_tokens == sum(map(len, got.values()))
