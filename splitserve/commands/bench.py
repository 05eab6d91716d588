"""`splitserve bench`: load a running gateway over gRPC or HTTP (and/or HF transformers
in-process on the same workload) and report TTFT, ITL, TPOT and e2e percentiles, throughput and
goodput; optionally as JSON and a PNG of latency CDFs.

    splitserve bench --backend grpc --backend hf --dataset sharegpt --num-prompts 64

The load generator (splitserve/loadgen) needs the `bench` extra; its modules are imported only
once `run` has checked that the extra is installed, so `--help` works without it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.engine.config import DEFAULT_CACHE_DIR
from splitserve.loadgen import datasets  # standard library only
from splitserve.loadgen.datasets import BenchRequest

if TYPE_CHECKING:
    from splitserve.loadgen.backends import RequestResult

BACKENDS = ("grpc", "http", "hf")
EXTRA_MODULES = ("httpx2", "matplotlib")  # what `pip install 'splitserve[bench]'` adds
DATASET_DEFAULTS = {  # dataset -> (input_len, output_len)
    "random": (128, 64), "shared-prefix": (100, 64),
    "sharegpt": (datasets.SHAREGPT_MEAN_INPUT, datasets.SHAREGPT_MEAN_OUTPUT)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("target")
    g.add_argument("--backend", action="append", default=None,
                   help=f"one of {', '.join(BACKENDS)}; repeat (or comma-separate) to run "
                        "several on the same workload (default: grpc)")
    g.add_argument("--grpc-address", default="127.0.0.1:50051", help="gateway gRPC host:port")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="gateway HTTP API base URL (its --http-port)")
    g.add_argument("--hf-model", default=None,
                   help="HF model directory for --backend hf (default: the default model, "
                        "converted into --model-cache-dir)")
    g.add_argument("--model-cache-dir", default=str(DEFAULT_CACHE_DIR),
                   help="where converted models are cached")
    g.add_argument("--hf-batch-size", type=int, default=64, help="HF static batch size")
    g.add_argument("--timeout-s", type=float, default=600.0, help="per-request deadline")
    w = parser.add_argument_group("workload")
    w.add_argument("--dataset", choices=tuple(DATASET_DEFAULTS), default="random",
                   help="random lengths, a shared system prompt, or ShareGPT-like lengths")
    w.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    w.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens (random: mean; shared-prefix: each request's own tokens; "
                        "sharegpt: mean); default per dataset: "
                        + ", ".join(f"{k} {v[0]}" for k, v in DATASET_DEFAULTS.items()))
    w.add_argument("--output-len", type=int, default=None,
                   help="output tokens (random: mean; sharegpt: mean); default per dataset: "
                        + ", ".join(f"{k} {v[1]}" for k, v in DATASET_DEFAULTS.items()))
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in len * [1 - r, 1 + r]")
    w.add_argument("--shared-len", type=int, default=500,
                   help="shared-prefix: tokens of the shared system prompt")
    w.add_argument("--max-input-len", type=int, default=1024, help="sharegpt: longest prompt")
    w.add_argument("--max-output-len", type=int, default=1024, help="sharegpt: longest output")
    w.add_argument("--vocab-size", type=int, default=49152,
                   help="prompt token ids are drawn below this (the served model's vocabulary)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals")
    w.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (inf: send all at once)")
    w.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    o = parser.add_argument_group("report")
    o.add_argument("--slo-ttft-ms", type=float, default=0.0, help="goodput: TTFT SLO (0 = none)")
    o.add_argument("--slo-tpot-ms", type=float, default=0.0, help="goodput: TPOT SLO (0 = none)")
    o.add_argument("--slo-e2e-ms", type=float, default=0.0,
                   help="goodput: e2e latency SLO (0 = none)")
    o.add_argument("--output-json", type=Path, default=None, help="write every figure here")
    o.add_argument("--plot", type=Path, default=None, help="write latency CDFs here (PNG)")
    o.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def missing_extra() -> list[str]:
    """The bench extra's modules that are not installed."""
    return [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]


def backends_of(values: list[str] | None) -> list[str]:
    names = [n.strip() for v in (values or ["grpc"]) for n in v.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {BACKENDS}")
    return list(dict.fromkeys(names))


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    default_in, default_out = DATASET_DEFAULTS[args.dataset]
    input_len = args.input_len or default_in
    output_len = args.output_len or default_out
    n, vocab, seed = args.num_prompts, args.vocab_size, args.seed
    if args.dataset == "random":
        return datasets.random_lengths(n, input_len, output_len, args.range_ratio, vocab, seed)
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix(n, args.shared_len, input_len, output_len, vocab, seed)
    return datasets.sharegpt_like(n, input_len, output_len, args.max_input_len,
                                  args.max_output_len, vocab, seed)


def run_backend(name: str, args: argparse.Namespace, workload: list[BenchRequest],
                ) -> tuple[list[RequestResult], float]:
    progress = not args.no_progress
    if name == "hf":
        from splitserve.loadgen.hf import run_hf  # imports torch and transformers
        return run_hf(hf_model_dir(args), workload, args.hf_batch_size, progress)
    from splitserve.loadgen.backends import Backend, GrpcBackend, HttpBackend
    from splitserve.loadgen.runner import run_online
    backend: Backend = (GrpcBackend(args.grpc_address, args.timeout_s) if name == "grpc"
                        else HttpBackend(args.base_url, args.timeout_s))
    return asyncio.run(run_online(backend, workload, args.request_rate, args.max_concurrency,
                                  args.seed, progress))


def hf_model_dir(args: argparse.Namespace) -> Path:
    if args.hf_model:
        return Path(args.hf_model)
    from common.models.loader import DEFAULT_MODEL, resolve_model
    return Path(resolve_model(DEFAULT_MODEL, args.model_cache_dir))


def run(args: argparse.Namespace) -> int:
    missing = missing_extra()
    if missing:
        print(f"splitserve bench needs the bench extra ({', '.join(missing)} not installed): "
              "pip install 'splitserve[bench]'", file=sys.stderr)
        return 2
    from splitserve.loadgen.report import Objectives, plot_cdfs, summarize, table, write_json
    try:
        names = backends_of(args.backend)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    workload = build_workload(args)
    objectives = Objectives(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000,
                            args.slo_e2e_ms / 1000)
    results: dict[str, list[RequestResult]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    for name in names:
        results[name], duration = run_backend(name, args, workload)
        summaries[name] = summarize(results[name], duration, objectives)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    output_tokens = sum(r.max_tokens for r in workload)
    print(f"\n{args.dataset}: {len(workload)} requests, {prompt_tokens} prompt and "
          f"{output_tokens} output tokens; request rate {args.request_rate}, max concurrency "
          f"{args.max_concurrency or 'unlimited'}")
    print(table(summaries))
    for name, s in summaries.items():
        for error in s["errors"][:5]:
            print(f"{name} error: {error}", file=sys.stderr)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k != "command"}
    if args.output_json:
        write_json(args.output_json, config, summaries, results)
    if args.plot:
        plot_cdfs(args.plot, results, f"{args.dataset}, {len(workload)} requests")
    failed = any(s["num_ok"] < s["num_requests"] for s in summaries.values())
    return 1 if failed else 0
