"""One trace per request across the stack (common/serving/tracing.py), from real processes: the
gateway, prefill and decode services export over OTLP/gRPC to a receiver this test runs (the
collector's TraceService, in process). A request sent with a W3C traceparent yields one trace
under the client's span: gateway.request, with gateway.route, prefill (queue, compute,
handoff.deliver -> handoff.pull on the decode service, with its transport and bytes) and decode
(reserve, wait_kv, generate) beneath it; a request without one starts its trace at the gateway.
A decode service killed mid-stream shows up as a migration event. Without --otlp-endpoint a
service sends no trace context at all (tests/common/serving/test_tracing.py)."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.cluster import Cluster, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "dummy:tiny-llama"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                "--cpu-threads", "1"]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: every exported span, flattened to a dict."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append({
                            "service": service, "name": s.name, "trace": s.trace_id.hex(),
                            "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                            "attrs": {a.key: _value(a.value) for a in s.attributes},
                            "events": [(e.name, {a.key: _value(a.value) for a in e.attributes})
                                       for e in s.events],
                            "error": s.status.code == s.status.STATUS_CODE_ERROR})
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]


def _value(v):
    return getattr(v, v.WhichOneof("value"))


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    rec.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec
    server.stop(0)


@pytest.fixture(scope="module")
def cluster(receiver, tmp_path_factory):
    otlp = ["--otlp-endpoint", f"127.0.0.1:{receiver.port}"]
    c = Cluster(tmp_path_factory.mktemp("tracing-logs"), MODEL, num_prefill=1, num_decode=2,
                engine_flags=ENGINE_FLAGS, prefill_flags=otlp, decode_flags=otlp,
                gateway_flags=otlp)
    try:
        c.wait_ready(120)
        yield c
    finally:
        c.close()


def request(max_tokens: int, prompt_len: int = 40) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=[3 + (7 * j) % 400 for j in range(prompt_len)]),
        params=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def tree(spans: list[dict]) -> str:
    """The trace as an indented list of name, service and duration (printed with -s)."""
    children = defaultdict(list)
    ids = {s["id"] for s in spans}
    for s in sorted(spans, key=lambda s: s["start"]):
        children[s["parent"] if s["parent"] in ids else None].append(s)
    lines: list[str] = []

    def walk(parent, depth):
        for s in children[parent]:
            lines.append(f"{'  ' * depth}{s['name']} [{s['service']}] "
                         f"{(s['end'] - s['start']) / 1e6:.2f} ms")
            walk(s["id"], depth + 1)
    walk(None, 0)
    return "\n".join(lines)


def test_one_trace_per_request_across_the_stages(cluster, receiver):
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
    messages = list(cluster.stub.GenerateStream(request(8), timeout=60,
                                                metadata=(("traceparent", traceparent),)))
    assert sum(len(m.token_ids) for m in messages) == 8

    wanted = {"gateway.request", "gateway.route", "prefill", "prefill.queue", "prefill.compute",
              "handoff.deliver", "handoff.pull", "decode", "decode.reserve", "decode.wait_kv",
              "decode.generate"}
    spans = wait_until("the whole trace exported", lambda: (
        lambda got: got if wanted <= {s["name"] for s in got} else None)(
            receiver.trace(TRACE_ID)), 30, interval_s=0.2)
    print("\n" + tree(spans))
    by_name = {s["name"]: s for s in spans}
    assert sorted(s["name"] for s in spans) == sorted(wanted)  # one of each, nothing else
    parent = {name: next((p["name"] for p in spans if p["id"] == s["parent"]), s["parent"])
              for name, s in by_name.items()}
    assert parent == {
        "gateway.request": CLIENT_SPAN, "gateway.route": "gateway.request",
        "prefill": "gateway.request", "decode": "gateway.request",
        "prefill.queue": "prefill", "prefill.compute": "prefill", "handoff.deliver": "prefill",
        "handoff.pull": "handoff.deliver", "decode.reserve": "decode",
        "decode.wait_kv": "decode", "decode.generate": "decode"}
    services = {name: s["service"] for name, s in by_name.items()}
    assert {services[n] for n in ("gateway.request", "gateway.route")} == {"splitserve-gateway"}
    assert {services[n] for n in ("prefill", "prefill.compute", "handoff.deliver")} == {
        "splitserve-prefill"}
    assert {services[n] for n in ("handoff.pull", "decode", "decode.generate")} == {
        "splitserve-decode"}

    pull = by_name["handoff.pull"]["attrs"]
    assert pull["splitserve.transport"] in ("local", "shm", "grpc")
    assert pull["splitserve.bytes"] == by_name["handoff.deliver"]["attrs"]["splitserve.bytes"] > 0
    assert pull["splitserve.gb_per_s"] > 0
    assert by_name["handoff.deliver"]["attrs"]["splitserve.accepted"] is True
    top = by_name["gateway.request"]
    assert top["attrs"]["splitserve.completion_tokens"] == 8
    assert not any(s["error"] for s in spans)
    for s in spans:  # children within their parent's time (clocks of one host); a call on
        # another service may end a little after its caller: its stream's tail (freeing the
        # request, ending the span) runs after the caller has read the last message.
        p = next((q for q in spans if q["id"] == s["parent"]), None)
        if p is not None:
            tail = 2_000_000 if s["service"] == p["service"] else 50_000_000
            assert p["start"] - 2_000_000 <= s["start"] <= s["end"] <= p["end"] + tail, s


def test_a_request_without_trace_context_starts_its_trace_at_the_gateway(cluster, receiver):
    before = {s["trace"] for s in receiver.spans}
    list(cluster.stub.GenerateStream(request(4, prompt_len=30), timeout=60))

    def new_trace():
        fresh = [s for s in receiver.spans if s["trace"] not in before]
        return fresh if {"gateway.request", "decode.generate", "handoff.pull"} <= {
            s["name"] for s in fresh} else None
    spans = wait_until("a new trace", new_trace, 30, interval_s=0.2)
    assert len({s["trace"] for s in spans}) == 1
    (root,) = [s for s in spans if s["name"] == "gateway.request"]
    assert root["parent"] == ""


def test_a_migration_is_an_event_of_the_request(cluster, receiver):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    outcome: dict = {}

    outcome["tokens"] = tokens = []

    def stream():
        for m in cluster.stub.GenerateStream(
                request(300, prompt_len=50), timeout=120,
                metadata=(("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01"),)):
            tokens.extend(m.token_ids)
    thread = threading.Thread(target=stream)
    thread.start()
    decoding = wait_until("a decode service at work", lambda: [
        slot for slot, iid in cluster.instance_ids.items()
        if slot.startswith("decode") and _decoding(cluster, iid)], 60, interval_s=0.05)
    # Killed once a few tokens reached the client, long before the 300th: a sleep here let a
    # fast run finish first (no migration to record).
    wait_until("the first tokens", lambda: len(tokens) >= 4, 60, interval_s=0.005)
    assert len(tokens) < 300
    cluster.kill(decoding[0])
    thread.join(120)
    assert len(outcome["tokens"]) == 300
    spans = wait_until("the request's span", lambda: [
        s for s in receiver.trace(trace_id) if s["name"] == "gateway.request"] or None, 30,
        interval_s=0.2)
    events = [name for name, _ in spans[0]["events"]]
    assert events == ["migration"], spans[0]["events"]
    attrs = spans[0]["events"][0][1]
    assert attrs["splitserve.tokens_sent"] > 0
    assert attrs["splitserve.failed_instance"] == cluster.instance_ids[decoding[0]]
    # The prefill service computed the prompt twice (the second time with the tokens sent),
    # under the same request span; the killed decode service never exported its spans.
    # (Another process's export: waited for, as the gateway's span was.)
    def both_prefills():
        found = [s for s in receiver.trace(trace_id) if s["name"] == "prefill"]
        return found if len(found) >= 2 else None
    prefills = wait_until("both prefill spans", both_prefills, 30, interval_s=0.2)
    assert len(prefills) == 2 and {s["parent"] for s in prefills} == {spans[0]["id"]}

def _decoding(cluster: Cluster, instance_id: str) -> bool:
    stats = cluster.stats().get(instance_id)
    return stats is not None and stats.num_running > 0
