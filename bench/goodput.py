"""Goodput of colocated engines against the same resources split into prefill and decode
(DistServe's measure), in one run.

    .venv/bin/python bench/goodput.py [--rates 0.5,1,2,3] [--requests 40] [--out out/goodput.json]

Two stacks on the same machine, one after the other at every rate, each behind its own gateway
and registry (the command lines of splitserve.launch):

- colocated: two decode services that prefill every prompt themselves (the gateway's
  --local-prefill-max-tokens above every prompt), each engine with --cpu-threads N;
- disaggregated: one prefill and one decode service, each with --cpu-threads N; the prompt's KV
  goes from one to the other (DecodeService.Deliver over shared memory on one host).

(The stack needs a registered prefill instance to be ready, so the colocated one runs one too;
it serves nothing, since no prompt is longer than the local-prefill limit.) On the 2-core box
N = 1: two engines, one core each, either way. On a GPU host pass --device cuda:0/cuda:1 style
pairs (--devices) to put the two engines of either stack on two GPUs.

Poisson arrivals at each rate (splitserve.loadgen), random prompts of --input-len tokens and
--output-len output tokens (new prompts at every rate, so no prefix-cache hits), greedy, EOS
ignored. A request meets the SLO when its TTFT is at most
--slo-ttft-ms and its TPOT at most --slo-tpot-ms; SLO attainment is the fraction that meets it,
goodput the requests per second that do. Prints a table per rate, the highest rate each stack
sustains at --attainment (default 90 %) attainment, and writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
from pathlib import Path

import grpc

from common.registry import EmbeddedRedis
from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc
from splitserve.launch import service_argv, start_service, stop_services
from splitserve.loadgen.backends import GrpcBackend
from splitserve.loadgen.datasets import random_lengths
from splitserve.loadgen.report import Objectives, summarize
from splitserve.loadgen.runner import run_online

STACKS = ("colocated", "disaggregated")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="model of every engine")
    p.add_argument("--rates", default="0.5,1,2,3", help="request rates to sweep (req/s)")
    p.add_argument("--requests", type=int, default=40, help="requests per rate and stack")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (mean)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (mean)")
    p.add_argument("--range-ratio", type=float, default=0.25,
                   help="lengths uniform in mean * (1 +- this)")
    p.add_argument("--vocab", type=int, default=49152, help="prompt token ids below this")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT objective (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="TPOT objective (ms)")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="SLO attainment at which the sustained rate is read")
    p.add_argument("--cpu-threads", type=int, default=1, help="threads of each CPU engine")
    p.add_argument("--devices", default="cpu,cpu",
                   help="devices of the two engines of each stack, comma-separated")
    p.add_argument("--num-kv-blocks", type=int, default=512, help="KV blocks of each engine")
    p.add_argument("--engine-flags", default="", help="more flags for every engine")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--out", default="out/goodput.json", help="JSON path (PNG beside it)")
    return p.parse_args()


class Stack:
    """Redis, two engine services and a gateway: `colocated` (two decode services prefilling
    locally, plus an idle prefill service for readiness) or `disaggregated`."""

    def __init__(self, kind: str, args: argparse.Namespace, log_dir: Path):
        self.kind = kind
        self.redis = EmbeddedRedis()
        self.port = free_port()
        devices = args.devices.split(",")
        engine = ["--num-kv-blocks", str(args.num_kv_blocks), "--cpu-threads",
                  str(args.cpu_threads), *shlex.split(args.engine_flags)]
        roles = [("prefill", devices[0]), ("decode", devices[1])]
        gateway = ["--request-timeout-s", "600"]
        if kind == "colocated":
            roles = [("decode", devices[0]), ("decode", devices[1]), ("prefill", "cpu")]
            gateway += ["--local-prefill-max-tokens", "1000000"]
        self.procs = []
        for i, (role, device) in enumerate([*roles, ("gateway", "")]):
            extra = gateway if role == "gateway" else [*engine, "--device", device]
            if kind == "colocated" and role == "prefill":  # idle: keep it small
                extra = ["--num-kv-blocks", "16", "--cpu-threads", "1", "--device", "cpu"]
            log = open(log_dir / f"{kind}-{role}-{i}.log", "wb")  # noqa: SIM115 (child keeps it)
            self.procs.append(start_service(
                service_argv(role, registry_url=self.redis.url, namespace=kind,
                             port=self.port if role == "gateway" else 0, model=args.model,
                             extra=extra), stdout=log, stderr=log))
        self.expected = {"prefill": 1, "decode": 2 if kind == "colocated" else 1}

    def wait_ready(self, timeout_s: float = 600) -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"a service of the {self.kind} stack exited")
                try:
                    info = stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=2)
                    if (info.num_prefill_instances >= self.expected["prefill"]
                            and info.num_decode_instances >= self.expected["decode"]):
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
            raise TimeoutError(f"the {self.kind} stack did not come up")
        finally:
            channel.close()

    def close(self) -> None:
        stop_services(self.procs)
        self.redis.stop()


def sustained_rate(rows: list[dict], attainment: float) -> float:
    """The highest swept rate at which attainment held (and held at every lower rate)."""
    best = 0.0
    for row in sorted(rows, key=lambda r: r["rate"]):
        if row["attainment"] < attainment:
            break
        best = row["rate"]
    return best


def plot(path: Path, rows: dict[str, list[dict]], args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, series in rows.items():
        rates = [r["rate"] for r in series]
        left.plot(rates, [100 * r["attainment"] for r in series], marker="o", label=kind)
        right.plot(rates, [r["goodput"] for r in series], marker="o", label=kind)
    left.axhline(100 * args.attainment, color="grey", linestyle="--", linewidth=0.8)
    left.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105),
             title=f"TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    right.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="goodput")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    args = parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    objectives = Objectives(ttft_s=args.slo_ttft_ms / 1e3, tpot_s=args.slo_tpot_ms / 1e3)
    # One workload per rate (both stacks get the same one): a prompt sent twice would hit the
    # prefix cache the second time.
    workloads = [random_lengths(args.requests, args.input_len, args.output_len, args.range_ratio,
                                args.vocab, args.seed + 1 + i) for i in range(len(rates))]
    warmup = random_lengths(4, args.input_len, args.output_len, args.range_ratio, args.vocab,
                            args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="goodput-"))
    rows: dict[str, list[dict]] = {kind: [] for kind in STACKS}
    # Both stacks stay up; at every rate one runs after the other, so a drift in the machine's
    # load meets both. Warm-up: a few requests through each before the sweep.
    stacks = {kind: Stack(kind, args, log_dir) for kind in STACKS}
    try:
        for stack in stacks.values():
            stack.wait_ready()
        for stack in stacks.values():
            asyncio.run(run_online(GrpcBackend(f"127.0.0.1:{stack.port}", 600.0), warmup,
                                   float("inf"), None, args.seed, progress=False))
        for rate, workload in zip(rates, workloads, strict=True):
            for kind, stack in stacks.items():
                results, duration = asyncio.run(run_online(
                    GrpcBackend(f"127.0.0.1:{stack.port}", 600.0), workload, rate, None,
                    args.seed, progress=False))
                s = summarize(results, duration, objectives)
                row = {"rate": rate, "attainment": s["goodput_fraction"],
                       "goodput": s["goodput"], "num_ok": s["num_ok"],
                       "ttft_p50_ms": 1e3 * (s["ttft"]["p50"] or 0),
                       "ttft_p90_ms": 1e3 * (s["ttft"]["p90"] or 0),
                       "tpot_p50_ms": 1e3 * (s["tpot"]["p50"] or 0),
                       "tpot_p90_ms": 1e3 * (s["tpot"]["p90"] or 0),
                       "output_throughput": s["output_throughput"], "errors": s["errors"]}
                rows[kind].append(row)
                print(f"rate {rate:>5.2f}  {kind:<14} attainment {100 * row['attainment']:5.1f} %"
                      f"  goodput {row['goodput']:5.2f} req/s  TTFT p50/p90 "
                      f"{row['ttft_p50_ms']:7.1f}/{row['ttft_p90_ms']:7.1f} ms  TPOT p50/p90 "
                      f"{row['tpot_p50_ms']:6.1f}/{row['tpot_p90_ms']:6.1f} ms", flush=True)
    finally:
        for stack in stacks.values():
            stack.close()
    sustained = {kind: sustained_rate(series, args.attainment) for kind, series in rows.items()}
    print(f"\nhighest rate at >= {100 * args.attainment:g} % SLO attainment: "
          + ", ".join(f"{kind} {rate:g} req/s" for kind, rate in sustained.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "rows": rows, "sustained_rate": sustained,
                               "logs": str(log_dir)}, indent=2))
    plot(out.with_suffix(".png"), rows, args)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
