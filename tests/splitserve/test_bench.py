"""`splitserve bench` pieces that need no stack: workloads, figures, table, JSON, CDF plot, and the
HF backend on a small workload. (The gRPC and HTTP backends run against a live stack in
tests/stack/test_observability.py.)"""

from __future__ import annotations

import argparse
import json
import statistics

import pytest

from bench.loadgen import datasets
from bench.loadgen.backends import RequestResult
from bench.loadgen.report import Objectives, plot_cdfs, summarize, table, write_json
from splitserve.cli import COMMANDS
from splitserve.commands import bench


def test_random_lengths_are_seeded_and_in_range():
    a = datasets.random_lengths(50, 100, 20, 0.5, vocab_size=1000, seed=3)
    assert a == datasets.random_lengths(50, 100, 20, 0.5, vocab_size=1000, seed=3)
    assert a != datasets.random_lengths(50, 100, 20, 0.5, vocab_size=1000, seed=4)
    assert all(50 <= len(r.prompt_token_ids) <= 150 and 10 <= r.max_tokens <= 30 for r in a)
    assert all(datasets.FIRST_ID <= t < 1000 for r in a for t in r.prompt_token_ids)
    fixed = datasets.random_lengths(5, 64, 8, 0.0, vocab_size=1000, seed=0)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in fixed] == [(64, 8)] * 5


def test_shared_prefix_shares_exactly_the_system_prompt():
    reqs = datasets.shared_prefix(4, shared_len=500, new_len=100, output_len=7,
                                  vocab_size=49152, seed=0)
    system = reqs[0].prompt_token_ids[:500]
    assert all(len(r.prompt_token_ids) == 600 and r.max_tokens == 7 for r in reqs)
    assert all(r.prompt_token_ids[:500] == system for r in reqs)
    assert len({tuple(r.prompt_token_ids[500:]) for r in reqs}) == 4


def test_sharegpt_like_lengths():
    reqs = datasets.sharegpt_like(4000, 161, 338, max_input=1024, max_output=1024,
                                  vocab_size=49152, seed=0)
    inputs = [len(r.prompt_token_ids) for r in reqs]
    outputs = [r.max_tokens for r in reqs]
    assert min(inputs) >= 4 and max(inputs) <= 1024 and max(outputs) <= 1024
    # Lognormal means of 161 and 338, a little lower after clipping the tails at 1024.
    assert 140 < statistics.mean(inputs) < 165 and 310 < statistics.mean(outputs) < 340
    assert statistics.median(inputs) < statistics.mean(inputs)  # a long right tail


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


def test_cli_registration_and_backend_parsing():
    assert "bench" in COMMANDS
    assert bench.backends_of(None) == ["grpc"]
    assert bench.backends_of(["grpc,hf", "http", "hf"]) == ["grpc", "hf", "http"]
    with pytest.raises(ValueError, match="unknown backend"):
        bench.backends_of(["vllm"])
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--dataset", "shared-prefix", "--num-prompts", "3",
                              "--shared-len", "32", "--input-len", "8", "--vocab-size", "500"])
    work = bench.build_workload(args)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in work] == [(40, 64)] * 3


def test_hf_backend_on_a_small_workload(smollm2_dir):
    from bench.loadgen.hf import run_hf
    work = datasets.random_lengths(3, 8, 3, 0.5, vocab_size=49152, seed=0)
    results, duration = run_hf(smollm2_dir, work, batch_size=2, progress=False)
    assert [r.output_len for r in results] == [r.max_tokens for r in work]
    assert all(len(r.itl) == r.output_len - 1 for r in results)
    assert all(r.ok and 0 < r.ttft <= r.e2e <= duration for r in results)
    assert results[2].start >= results[0].e2e  # the second batch starts after the first
