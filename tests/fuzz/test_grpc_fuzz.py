"""Hypothesis fuzzing of the public gRPC API of a running stack (gateway, one prefill, one decode;
the dummy tiny-llama model: vocabulary 512, context 2048).

Whatever arrives (random bytes, truncated messages, out-of-range or non-finite parameters, empty
and oversized prompts, unknown models, thousands of stop strings), the answer is a normal stream
or INVALID_ARGUMENT (the documented status for a bad request), never anything else; the services
stay up and, once it is all over, no KV block is referenced and no delivery is awaited.
"""

from __future__ import annotations

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "dummy:tiny-llama"
VOCAB, CONTEXT, MAX_STOPS = 512, 2048, 64
ENGINE_FLAGS = ["--device", "cpu", "--num-kv-blocks", "256", "--max-num-batched-tokens", "1024"]
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
OK, BAD = "ok", grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("fuzz-logs"), MODEL, num_prefill=1, num_decode=1,
                engine_flags=ENGINE_FLAGS, gateway_flags=["--max-inflight", "64"])
    try:
        c.wait_ready(timeout_s=120)
        yield c
        # Afterwards: everyone alive and serving, nothing referenced, no record left.
        assert all(p.poll() is None for p in c.procs.values()), c.logs()
        with grpc.insecure_channel(f"127.0.0.1:{c.gateway_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert c.wait_idle(timeout_s=15) == {}
    finally:
        c.close()


def outcome(fn, request, stream: bool = True, timeout: float = 30.0) -> tuple[object, str]:
    """("ok", "") for an answer that ended with a finish reason, else (status code, details)."""
    try:
        msgs = list(fn(request, timeout=timeout)) if stream else [fn(request, timeout=timeout)]
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    assert msgs and msgs[-1].finish_reason, msgs
    return OK, ""


def raw_stream(cluster: Cluster):
    return cluster.channel.unary_stream(
        "/splitserve.v1.GenerationService/GenerateStream", request_serializer=None,
        response_deserializer=generation_pb2.GenerateStreamResponse.FromString)


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
any_float = st.floats(width=32)  # NaN and infinities included
token = st.integers(0, 2**32 - 1)


@st.composite
def sampling_params(draw) -> types_pb2.SamplingParams:
    p = types_pb2.SamplingParams()
    for name, strategy in (("max_tokens", st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1))),
                           ("temperature", any_float), ("top_p", any_float),
                           ("top_k", st.integers(-2**31, 2**31 - 1)), ("min_p", any_float),
                           ("seed", st.integers(0, 2**64 - 1)),
                           ("repetition_penalty", any_float), ("frequency_penalty", any_float),
                           ("presence_penalty", any_float), ("skip_special_tokens", st.booleans())):
        if draw(st.booleans()):
            setattr(p, name, draw(strategy))
    p.stop.extend(draw(st.one_of(st.lists(st.text(max_size=8), max_size=4),
                                 st.lists(st.text(max_size=3), min_size=60, max_size=3000))))
    p.stop_token_ids.extend(draw(st.lists(token, max_size=4)))
    p.ignore_eos = draw(st.booleans())
    p.min_tokens = draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1)))
    p.include_stop_str_in_output = draw(st.booleans())
    return p


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=300))),
        model=draw(st.sampled_from(["", MODEL, "gpt-4", "dummy:tiny-llama "])),
        params=draw(sampling_params()))
    kind = draw(st.sampled_from(["ids", "ids", "prompt", "messages", "none"]))
    if kind == "ids":
        ids = draw(st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=64),
                             st.lists(token, min_size=1, max_size=8),
                             st.lists(st.integers(0, VOCAB - 1), min_size=CONTEXT - 8,
                                      max_size=CONTEXT + 8)))
        req.prompt_token_ids.ids.extend(ids)
    elif kind == "prompt":
        req.prompt = draw(st.text(max_size=64))
    elif kind == "messages":
        req.messages.messages.add(role=draw(st.sampled_from(["user", "robot", ""])),
                                  content=draw(st.text(max_size=32)))
    return req


def valid(req: generation_pb2.GenerateRequest) -> bool:
    """The documented rules a request must meet to be served (dummy model: token ids only)."""
    p = req.params
    max_tokens = p.max_tokens if p.HasField("max_tokens") else 16
    ids = list(req.prompt_token_ids.ids)

    def opt(name: str, default: float) -> float:
        return getattr(p, name) if p.HasField(name) else default

    floats_ok = (opt("temperature", 1.0) >= 0 and 0 < opt("top_p", 1.0) <= 1
                 and 0 <= opt("min_p", 0.0) <= 1 and opt("repetition_penalty", 1.0) > 0
                 and -2 <= opt("frequency_penalty", 0.0) <= 2
                 and -2 <= opt("presence_penalty", 0.0) <= 2)  # NaN fails every comparison
    return (req.model in ("", MODEL) and len(req.request_id) <= 256
            and req.WhichOneof("input") == "prompt_token_ids" and len(ids) > 0
            and all(t < VOCAB for t in ids) and len(ids) + max_tokens <= CONTEXT
            and max_tokens >= 1 and floats_ok and opt("top_k", -1) >= -1
            and (not p.HasField("seed") or p.seed < 2**63) and len(p.stop) <= MAX_STOPS
            and all(p.stop))


@FUZZ
@given(req=generate_requests())
def test_structured_requests_get_a_stream_or_invalid_argument(cluster, req):
    if req.params.max_tokens > 8 and valid(req):
        req.params.max_tokens = 8  # keep the valid ones short
    code, details = outcome(cluster.stub.GenerateStream, req)
    assert code == (OK if valid(req) else BAD), (code, details)
    if code == BAD:
        assert details  # says what to change


@FUZZ
@given(data=st.binary(max_size=256))
def test_random_bytes_are_refused_or_parsed(cluster, data):
    try:
        parsed = generation_pb2.GenerateRequest.FromString(data)
    except Exception:
        parsed = None
    if parsed is not None and valid(parsed) and (parsed.params.max_tokens > 8
                                                 or parsed.params.min_tokens):
        return  # a valid long request: the structured test covers those
    code, details = outcome(raw_stream(cluster), data)
    want = OK if parsed is not None and valid(parsed) else BAD
    assert code == want, (code, details)


@FUZZ
@given(req=generate_requests(), cut=st.integers(1, 4096))
def test_truncated_messages(cluster, req, cut):
    data = req.SerializeToString()
    data = data[:max(0, len(data) - cut)]
    try:
        parsed = generation_pb2.GenerateRequest.FromString(data)
    except Exception:
        parsed = None
    if parsed is not None and valid(parsed):
        return  # still a valid request after the cut: not what this test is about
    assert outcome(raw_stream(cluster), data)[0] == BAD


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", math.nan), ("temperature", -math.inf), ("top_p", math.nan),
    ("top_p", 0.0), ("min_p", math.inf), ("repetition_penalty", 0.0),
    ("frequency_penalty", math.nan), ("presence_penalty", 2.5), ("max_tokens", 0),
    ("max_tokens", 2**32 - 1), ("seed", 2**64 - 1), ("top_k", -5),
])
def test_each_out_of_range_parameter(cluster, field, value):
    req = generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.TokenIds(ids=[5, 6]))
    setattr(req.params, field, value)
    code, details = outcome(cluster.stub.GenerateStream, req)
    assert code == BAD and details


def test_named_refusals(cluster):
    ids = generation_pb2.TokenIds(ids=[5, 6, 7])
    cases = [
        (generation_pb2.GenerateRequest(), "set one of prompt, prompt_token_ids or messages"),
        (generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.TokenIds()),
         "the prompt is empty"),
        (generation_pb2.GenerateRequest(prompt_token_ids=ids, model="gpt-4"),
         "model 'gpt-4' is not served here; this gateway serves 'dummy:tiny-llama'"),
        (generation_pb2.GenerateRequest(prompt="hello"),
         "dummy:tiny-llama has no tokenizer: send prompt_token_ids"),
        (generation_pb2.GenerateRequest(prompt_token_ids=ids, params=types_pb2.SamplingParams(
            stop=[f"s{i}" for i in range(5000)])), "at most 64 stop strings, got 5000"),
        (generation_pb2.GenerateRequest(prompt_token_ids=ids, request_id="x" * 257),
         "request_id is longer than 256 characters"),
    ]
    for req, message in cases:
        assert outcome(cluster.stub.GenerateStream, req) == (BAD, message)
    huge = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=[5] * 300_000))
    code, details = outcome(cluster.stub.GenerateStream, huge)
    assert code == BAD and "context length (2048)" in details
    bad_utf8 = b"\x1a\x02\xff\xfe"  # field 3 (prompt): two bytes that are not UTF-8
    code, details = outcome(raw_stream(cluster), bad_utf8)
    assert code == BAD and "UTF-8" in details


def test_other_methods_with_junk(cluster):
    stub = cluster.stub
    for rid in ("", "nope", "x" * 10_000):
        assert not stub.Abort(types_pb2.AbortRequest(request_id=rid), timeout=5).found
    code, details = outcome(stub.Tokenize, generation_pb2.TokenizeRequest(prompt="hi"),
                            stream=False)
    assert (code, details) == (BAD, "dummy:tiny-llama has no tokenizer: send prompt_token_ids")
    unary = cluster.channel.unary_unary(
        "/splitserve.v1.GenerationService/Generate", request_serializer=None,
        response_deserializer=generation_pb2.GenerateResponse.FromString)
    assert outcome(unary, b"\xff\xff\xff", stream=False)[0] == BAD
