"""Metrics and the load generator against a live stack (one gateway, one prefill, one decode
service, the real model): every service's /metrics moves exactly as the traffic says, promtool
accepts every exposition, every metric the Grafana dashboard queries is exported, and
`splitserve bench` drives the gRPC and HTTP APIs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.serving.metrics import SLO, DecodeMetrics, EngineStats, SpecDecodeStats
from protos.splitserve.v1 import generation_pb2, types_pb2
from splitserve.cli import main as cli_main
from tests.stack.conftest import Stack

pytestmark = pytest.mark.slow

BLOCK = 16
# SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64, float32.
KV_BYTES_PER_BLOCK = 30 * 2 * BLOCK * 3 * 64 * 4


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("observability-stack"), num_prefill=1, num_decode=1)
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


def exposition(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(exposition(port)):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = ("splitserve_" + name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def test_metrics_move_with_traffic(small_stack: Stack):
    ports = small_stack.metrics_ports
    prompt = [100 + (37 * i) % 40000 for i in range(200)]  # 12 full blocks and 8 tokens
    before = {name: scrape(port) for name, port in ports.items()}
    for i in range(2):  # the same prompt twice: the second finds 12 blocks in the prefix cache
        request = generation_pb2.GenerateRequest(
            request_id=f"observe-{i}", prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
            params=types_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        final = small_stack.stub.Generate(request, timeout=120.0)
        assert final.usage.num_cached_tokens == (192 if i else 0)
    after = {name: scrape(port) for name, port in ports.items()}
    gw, pf, dc = (before["gateway"], after["gateway"]), (before["prefill-0"], after["prefill-0"]), \
        (before["decode-0"], after["decode-0"])
    assert delta(*gw, "time_to_first_token_seconds_count") == 2
    assert delta(*gw, "e2e_request_latency_seconds_count") == 2
    assert delta(*gw, "request_success_total", finished_reason="length") == 2
    assert delta(*gw, "generation_tokens_total") == 8
    assert delta(*gw, "prompt_tokens_total") == 400
    assert delta(*pf, "prefix_cache_queries_total") == 400
    assert delta(*pf, "prefix_cache_hits_total") == 192
    assert delta(*pf, "time_to_first_token_seconds_count") == 2
    assert delta(*pf, "handoffs_delivered_total") == 2
    assert delta(*dc, "handoff_bytes_total", transport="shm") == 2 * 13 * KV_BYTES_PER_BLOCK
    assert delta(*dc, "handoff_seconds_count", transport="shm") == 2
    # One host, plaintext: the doorbell starts the pull (it may lose the race to the Deliver
    # call on a loaded box, which then pulls instead: never both, the pull count above).
    assert delta(*dc, "handoff_doorbell_rings_total") >= 1
    assert delta(*dc, "inter_token_latency_seconds_count") == 4  # tokens 2-4: two gaps each
    assert delta(*dc, "goodput_requests_total", stage="decode", slo_met="true") == 2
    assert after["prefill-0"][("splitserve_num_requests_running", ())] == 0


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_every_service(small_stack: Stack):
    for name, port in small_stack.metrics_ports.items():
        result = subprocess.run(["promtool", "check", "metrics"],
                                input=exposition(port).encode(), capture_output=True, timeout=30)
        assert result.returncode == 0, (name, result.stdout, result.stderr)


def test_bench_drives_grpc_and_http(small_stack: Stack, tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "cdf.png"
    code = cli_main([
        "bench", "--backend", "grpc,http", "--grpc-address",
        f"127.0.0.1:{small_stack.gateway_port}", "--base-url",
        f"http://127.0.0.1:{small_stack.http_port}", "--dataset", "shared-prefix",
        "--num-prompts", "4", "--shared-len", "48", "--input-len", "8", "--output-len", "3",
        "--request-rate", "20", "--seed", "1", "--slo-ttft-ms", "600000", "--no-progress",
        "--output-json", str(out), "--plot", str(plot)])
    assert code == 0
    summaries = json.loads(out.read_text())["summaries"]
    for name in ("grpc", "http"):
        s = summaries[name]
        assert (s["num_ok"], s["output_tokens"], s["prompt_tokens"]) == (4, 12, 224)
        assert s["goodput_fraction"] == 1.0 and s["errors"] == []
        assert s["itl"]["p50"] is not None
    # The 48-token system prompt is 3 blocks: every request after the first finds them cached.
    assert summaries["http"]["cached_tokens"] == 4 * 48
    assert plot.read_bytes()[:4] == b"\x89PNG"


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / \
    "splitserve.json"
# The series of one TYPE line (a counter's line names its _total series already).
SERIES_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def test_the_dashboard_queries_only_exported_metrics(small_stack: Stack):
    """Every splitserve_* series in deploy/grafana's dashboard is in some service's /metrics
    (a family declared by its TYPE line, so labelled counters with no sample yet count), and
    every stage's metrics appear on the dashboard."""
    texts = [(name.split("-")[0], exposition(port))
             for name, port in small_stack.metrics_ports.items()]
    # A decode service that speculates also exports the spec_decode_* counters (this stack does
    # not speculate): the same collector, given speculation's figures.
    speculating = DecodeMetrics("m", SLO(), lambda: EngineStats(
        0, 0, 0.0, 0, 0, 0, SpecDecodeStats(5, 20, 12, (5, 4, 2, 1))))
    texts.append(("decode", speculating.exposition().decode()))
    exported: dict[str, set[str]] = {}  # series name -> the jobs (roles) exporting it
    for role, text in texts:
        for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
            for suffix in SERIES_SUFFIXES.get(kind, ("",)):
                exported.setdefault(family + suffix, set()).add(role)
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
             for t in p.get("targets", ())]
    queried = {m for e in exprs for m in re.findall(r"splitserve_[a-z0-9_]+", e)}
    assert sorted(queried - set(exported)) == []
    assert set().union(*(exported[m] for m in queried)) == {"gateway", "prefill", "decode"}
    for e in exprs:  # each query names a job that exports its metrics
        for metric in re.findall(r"splitserve_[a-z0-9_]+", e):
            for jobs in re.findall(r'job=~?"([a-z|]+)"', e):
                assert set(jobs.split("|")) <= exported[metric], (e, exported[metric])
