"""Figures from per-request timings: exact percentiles, throughput and goodput; the table, the
JSON and the CDF plot."""

from __future__ import annotations

import json

import pytest

from splitserve.loadgen.backends import RequestResult
from splitserve.loadgen.report import Objectives, plot_cdfs, summarize, table, write_json


def result(start: float, ttft: float, gaps: list[float], cached: int = 0) -> RequestResult:
    return RequestResult(prompt_len=10, start=start, ttft=ttft, itl=gaps,
                         e2e=ttft + sum(gaps), output_len=len(gaps) + 1, cached_tokens=cached)


def test_summary_figures_are_exact():
    results = [result(0.0, 0.1, [0.02, 0.02]), result(0.5, 0.3, [0.05, 0.05], cached=5),
               RequestResult(prompt_len=10, error="UNAVAILABLE: no decode instance")]
    s = summarize(results, duration_s=2.0, objectives=Objectives(ttft_s=0.2, tpot_s=0.1))
    assert (s["num_requests"], s["num_ok"], s["output_tokens"], s["prompt_tokens"]) == (
        3, 2, 6, 20)
    assert (s["request_throughput"], s["output_throughput"]) == (1.0, 3.0)
    assert s["total_token_throughput"] == 13.0
    assert s["cached_tokens"] == 5
    assert s["goodput"] == 0.5 and s["goodput_fraction"] == pytest.approx(1 / 3)
    assert s["ttft"]["p50"] == pytest.approx(0.2) and s["ttft"]["mean"] == pytest.approx(0.2)
    assert s["tpot"]["p50"] == pytest.approx(0.035)
    assert s["itl"]["p90"] == pytest.approx(0.05)
    assert s["e2e"]["p99"] == pytest.approx(0.14 + 0.99 * (0.4 - 0.14))
    assert s["errors"] == ["UNAVAILABLE: no decode instance"]


def test_table_json_and_plot(tmp_path):
    ours = [result(0.0, 0.1, [0.02] * 3)]
    peer = [result(0.0, 0.4, [0.04] * 3)]
    summaries = {"grpc": summarize(ours, 1.0, Objectives()),
                 "hf": summarize(peer, 2.0, Objectives())}
    text = table(summaries)
    rows = {line.split("  ")[0].strip(): line.split() for line in text.splitlines()}
    assert rows["metric"][-3:] == ["grpc", "hf", "grpc-vs-hf"]
    assert rows["output tok/s"][-3:] == ["4", "2", "2.00x"]
    assert rows["TTFT p50 (ms)"][-3:] == ["100", "400", "4.00x"]
    write_json(tmp_path / "out.json", {"dataset": "random"}, summaries,
               {"grpc": ours, "hf": peer})
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["summaries"]["hf"]["output_throughput"] == 2.0
    assert data["requests"]["grpc"][0]["itl"] == [0.02] * 3
    plot_cdfs(tmp_path / "cdf.png", {"grpc": ours, "hf": peer}, "test")
    assert (tmp_path / "cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
