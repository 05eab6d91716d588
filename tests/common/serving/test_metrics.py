"""Metrics of the three services: exact values after known traffic, separate registries, the
HTTP endpoint, and promtool's verdict on every exposition."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine, RequestMetrics
from common.flags import build
from common.serving.metrics import (
    SLO,
    DecodeMetrics,
    EngineStats,
    GatewayMetrics,
    PrefillMetrics,
    SpecDecodeStats,
    StreamTimer,
    engine_stats,
)

MODEL = "tiny"


def samples(metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels without model_name) -> value."""
    text = metrics.exposition().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("model_name") == MODEL
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics, name: str, **labels: str) -> float:
    return samples(metrics)[("splitserve_" + name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(build(EngineConfig, model="dummy:tiny-llama", num_kv_blocks=64, block_size=16))


def test_slo_and_stream_timer():
    slo = SLO(ttft_s=0.5, tpot_s=0.1)
    assert slo.met(0.5, 0.1) and not slo.met(0.51, 0.05) and not slo.met(0.2, 0.11)
    assert slo.met(0.2, None) and not slo.met(None, 0.05)
    assert SLO().met(None, None) and SLO().met(100.0, 100.0)
    timer = StreamTimer(arrival=10.0)
    assert timer.add(1, 10.25) is None
    assert timer.add(2, 10.5) == 0.25
    assert timer.add(1, 11.25) == 0.75
    assert (timer.ttft, timer.num_tokens, timer.tpot) == (0.25, 4, 1.0 / 3)


def test_prefill_metrics_after_traffic(engine: LLMEngine):
    """A repeated prompt hits the prefix cache; TTFT is counted once per request served."""
    metrics = PrefillMetrics(MODEL, SLO(ttft_s=3600.0), lambda: engine_stats(engine))
    before = engine_stats(engine)
    prompt = [(7 * i) % 500 + 1 for i in range(100)]  # 6 full blocks of 16 and 4 tokens
    for _ in range(2):
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        metrics.observe_prefilled(out.metrics)
    assert value(metrics, "prefix_cache_queries_total") - before.prefix_cache_queries == 200
    assert value(metrics, "prefix_cache_hits_total") - before.prefix_cache_hits == 96
    assert value(metrics, "time_to_first_token_seconds_count") == 2
    assert value(metrics, "request_queue_time_seconds_count") == 2
    assert value(metrics, "goodput_requests_total", stage="prefill", slo_met="true") == 2
    assert value(metrics, "goodput_requests_total", stage="prefill", slo_met="false") == 0
    assert value(metrics, "num_requests_running") == 0
    assert value(metrics, "kv_cache_usage_perc") == 0.0


def test_prefill_delivery_counts():
    metrics = PrefillMetrics(MODEL, SLO(), lambda: EngineStats(1, 2, 0.25, 10, 5, 7))
    metrics.handoffs.inc()
    metrics.delivery_failures.inc()
    metrics.delivery_failures.inc()
    assert value(metrics, "handoffs_delivered_total") == 1
    assert value(metrics, "handoff_delivery_failures_total") == 2
    assert (value(metrics, "num_requests_running"), value(metrics, "num_requests_waiting"),
            value(metrics, "kv_cache_usage_perc"), value(metrics, "handoff_held_blocks")) == (
                1, 2, 0.25, 7)


def test_decode_metrics_exact():
    metrics = DecodeMetrics(MODEL, SLO(tpot_s=0.3), lambda: EngineStats(0, 0, 0.0, 0, 0, 0))
    metrics.observe_handoff("shm", 4096, 0.002)
    metrics.observe_handoff("shm", 1024, 0.004)
    for gaps in ([0.1, 0.2], [0.5, 0.5]):  # TPOT 0.15 (met), then 0.5 (missed)
        timer = StreamTimer(arrival=0.0)
        now = 1.0
        metrics.observe_tokens(timer, 1, now)
        for gap in gaps:
            now += gap
            metrics.observe_tokens(timer, 1, now)
        metrics.observe_finished(timer, RequestMetrics(0.0, 0.0, 1.0), now)
    assert value(metrics, "handoff_bytes_total", transport="shm") == 5120
    assert value(metrics, "handoff_seconds_count", transport="shm") == 2
    assert value(metrics, "handoff_seconds_sum", transport="shm") == pytest.approx(0.006)
    assert value(metrics, "handoff_failures_total", reason="transfer") == 0
    assert value(metrics, "inter_token_latency_seconds_count") == 4
    assert value(metrics, "inter_token_latency_seconds_sum") == pytest.approx(1.3)
    assert value(metrics, "e2e_request_latency_seconds_sum") == pytest.approx(1.3 + 2.0)
    assert value(metrics, "goodput_requests_total", stage="decode", slo_met="true") == 1
    assert value(metrics, "goodput_requests_total", stage="decode", slo_met="false") == 1


def test_gateway_metrics_exact():
    inflight = [3]
    metrics = GatewayMetrics(MODEL, SLO(ttft_s=1.0, tpot_s=0.2), lambda: inflight[0])
    timer = StreamTimer(arrival=5.0)
    metrics.observe_tokens(timer, 1, 5.5)
    metrics.observe_tokens(timer, 3, 5.8)
    metrics.observe_tokens(timer, 0, 5.9)  # an empty piece (text held back) is no token
    metrics.observe_finished(timer, "length", prompt_tokens=12, now=6.0)
    metrics.observe_failed("UNAVAILABLE")
    assert value(metrics, "num_requests_running") == 3
    assert value(metrics, "time_to_first_token_seconds_sum") == 0.5
    assert value(metrics, "inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert value(metrics, "request_time_per_output_token_seconds_sum") == pytest.approx(0.1)
    assert value(metrics, "e2e_request_latency_seconds_sum") == 1.0
    assert value(metrics, "generation_tokens_total") == 4
    assert value(metrics, "prompt_tokens_total") == 12
    assert value(metrics, "request_success_total", finished_reason="length") == 1
    assert value(metrics, "request_success_total", finished_reason="stop") == 0
    assert value(metrics, "request_failure_total", code="UNAVAILABLE") == 1
    assert value(metrics, "goodput_requests_total", stage="request", slo_met="true") == 1


def test_registries_are_separate_and_served_over_http():
    a = GatewayMetrics(MODEL, SLO(), lambda: 1)
    b = GatewayMetrics(MODEL, SLO(), lambda: 2)  # same names, no clash
    a.observe_failed("INTERNAL")
    assert value(a, "request_failure_total", code="INTERNAL") == 1
    assert ("splitserve_request_failure_total", (("code", "INTERNAL"),)) not in samples(b)
    server = b.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            body = r.read().decode()
        assert 'splitserve_num_requests_running{model_name="tiny"} 2.0' in body
    finally:
        server.close()


def test_health_beside_metrics():
    """/health answers the readiness report: 200 when ready, else 503; /metrics is unchanged."""
    report = {"status": "not ready", "kind": "decode", "instance_id": "d0"}
    server = GatewayMetrics(MODEL, SLO(), lambda: 0).serve("127.0.0.1", 0, lambda: report)
    url = f"http://127.0.0.1:{server.port}"
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/health", timeout=5)
        assert refused.value.code == 503
        assert json.loads(refused.value.read()) == report
        report["status"] = "ready"
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            assert (r.status, json.loads(r.read())) == (200, report)
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            assert b"splitserve_num_requests_running" in r.read()
    finally:
        server.close()


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_every_exposition(engine: LLMEngine):
    spec_stats = EngineStats(1, 0, 0.5, 100, 32, 0, SpecDecodeStats(5, 20, 12, (5, 4, 2, 1)))
    services = [
        GatewayMetrics(MODEL, SLO(ttft_s=1.0), lambda: 0),
        PrefillMetrics(MODEL, SLO(ttft_s=1.0), lambda: engine_stats(engine)),
        DecodeMetrics(MODEL, SLO(tpot_s=0.1), lambda: spec_stats),
    ]
    services[0].observe_tokens(StreamTimer(0.0), 1, 0.1)
    services[2].observe_handoff("grpc", 100, 0.01)
    for metrics in services:
        result = subprocess.run(["promtool", "check", "metrics"], input=metrics.exposition(),
                                capture_output=True, timeout=30)
        assert result.returncode == 0, (type(metrics).__name__, result.stdout, result.stderr)


def test_spec_decode_counters_exported():
    engine = LLMEngine(build(EngineConfig, model="dummy:tiny-llama", num_kv_blocks=64,
                                    speculative_method="ngram"))
    metrics = DecodeMetrics(MODEL, SLO(), lambda: engine_stats(engine))
    engine.generate([[5, 6, 7, 8] * 10], SamplingParams(max_tokens=24, temperature=0.0,
                                                          ignore_eos=True))
    c = engine.spec_counters
    assert c.num_drafts > 0
    assert value(metrics, "spec_decode_num_drafts_total") == c.num_drafts
    assert value(metrics, "spec_decode_num_draft_tokens_total") == c.num_draft_tokens
    assert value(metrics, "spec_decode_num_accepted_tokens_total") == c.num_accepted_tokens
    for position, count in enumerate(c.accepted_per_position):
        assert value(metrics, "spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(position)) == count
    off = LLMEngine(build(EngineConfig, model="dummy:tiny-llama", num_kv_blocks=8))
    plain = PrefillMetrics(MODEL, SLO(), lambda: engine_stats(off))
    assert not any(name.startswith("splitserve_spec_decode") for name, _ in samples(plain))
