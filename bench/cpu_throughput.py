"""CPU offline throughput on SmolLM2: splitserve's engine against HF `generate`, same run.

Workloads (issue 2, targets T10/T11 in ../shared/BENCHMARKS.md):
  uniform   64 requests, 128 prompt / 64 output tokens; HF at batch 64. Also reported as a
            fraction of the CPU compute floor: the workload's FLOPs over the fp32 GEMM rate
            measured in this run.
  sharegpt  64 requests, ShareGPT-like lengths (prompts 16-600, outputs 8-256, fixed seed);
            HF in static padded batches of 64 (each batch runs to its longest output).
EOS is ignored on both sides so every request generates exactly its output length.

    .venv/bin/python bench/cpu_throughput.py --json bench/results/cpu_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from datetime import date
from pathlib import Path

import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build, leaf
from common.models.ops_onednn import resolve_cpu_linear


def gemm_gflops(hidden: int, inter: int, tokens: int = 2048, repeats: int = 5) -> float:
    """fp32 GEMM rate on this machine at the model's MLP shape: the best of repeats, so that
    another process's burst on a shared box lowers neither the rate nor the floor's strictness."""
    a = torch.randn(tokens, hidden)
    b = torch.randn(hidden, inter)
    torch.mm(a, b)
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b)
        rates.append(10 * 2 * tokens * hidden * inter / (time.perf_counter() - t) / 1e9)
    return max(rates)


def workload_flops(mc, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Matmul FLOPs of the forward passes the workload needs (weights, attention, lm_head)."""
    h, d, L = mc.hidden_size, mc.head_dim, mc.num_layers
    q, kv = mc.num_heads * d, mc.num_kv_heads * d
    per_token = 2 * L * (h * (q + 2 * kv) + q * h + 3 * h * mc.intermediate_size)
    total = 0.0
    for p, o in zip(prompt_lens, output_lens, strict=True):
        n = p + o - 1  # the last sampled token is never fed back
        total += per_token * n
        total += 2 * L * 2 * q * (n * (n + 1) / 2)  # QK^T and PV over causal contexts
        total += 2 * h * mc.vocab_size * o  # logits for each sampled token
    return total


def make_workload(kind: str, n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    if kind == "uniform":
        plens, olens = [128] * n, [64] * n
    else:  # ShareGPT-like: long-tailed prompts and outputs, synthesised locally
        plens = [min(600, max(16, int(rng.lognormvariate(4.8, 0.8)))) for _ in range(n)]
        olens = [min(256, max(8, int(rng.lognormvariate(4.2, 0.9)))) for _ in range(n)]
    prompts = [[rng.randrange(100, vocab) for _ in range(p)] for p in plens]
    return prompts, olens


def run_ours(engine: LLMEngine, prompts, olens) -> float:
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in olens]
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    assert [len(o.output_token_ids) for o in outs] == olens
    return elapsed


def run_hf(model, prompts, olens, batch: int) -> float:
    t = time.perf_counter()
    for s in range(0, len(prompts), batch):
        chunk, outs = prompts[s:s + batch], olens[s:s + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(outs),
                           min_new_tokens=max(outs), do_sample=False, pad_token_id=0)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="uniform,sharegpt")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true", help="measure splitserve only")
    cpu_linear = leaf(EngineConfig, "cpu_linear")
    ap.add_argument("--cpu-linear", default=cpu_linear.default, help=cpu_linear.help)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()

    engine = LLMEngine(build(EngineConfig, num_kv_blocks=4096,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    cpu_linear=args.cpu_linear))
    mc = engine.model_config
    from common.models.loader import resolve_model
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(
            resolve_model(engine.config.model.name, engine.config.model.model_cache_dir),
            dtype=torch.float32).eval()
    load_before = os.getloadavg()
    rate = gemm_gflops(mc.hidden_size, mc.intermediate_size)
    rows = []
    for kind in args.workloads.split(","):
        prompts, olens = make_workload(kind, args.num_requests, mc.vocab_size)
        flops = workload_flops(mc, [len(p) for p in prompts], olens)
        ours = run_ours(engine, prompts, olens)
        theirs = run_hf(hf, prompts, olens, args.hf_batch) if hf is not None else None
        floor = flops / (rate * 1e9)
        rows.append({
            "workload": kind, "requests": len(prompts), "output_tokens": sum(olens),
            "prompt_tokens": sum(map(len, prompts)), "splitserve_s": round(ours, 2),
            "hf_s": round(theirs, 2) if theirs else None,
            "splitserve_tok_s": round(sum(olens) / ours, 1),
            "hf_tok_s": round(sum(olens) / theirs, 1) if theirs else None,
            "speedup_vs_hf": round(theirs / ours, 2) if theirs else None,
            "compute_floor_s": round(floor, 2), "fraction_of_floor": round(floor / ours, 3),
        })
    load = {"before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()]}
    print(f"fp32 GEMM rate: {rate:.1f} GFLOP/s  ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads); load average (1, 5, 15 min) before "
          f"{load['before']}, after {load['after']}")
    print(f"{'workload':<10}{'ours s':>9}{'HF s':>9}{'ours tok/s':>12}{'HF tok/s':>10}"
          f"{'x HF':>7}{'floor s':>9}{'of floor':>10}")
    for r in rows:
        print(f"{r['workload']:<10}{r['splitserve_s']:>9}{r['hf_s'] or '-':>9}"
              f"{r['splitserve_tok_s']:>12}{r['hf_tok_s'] or '-':>10}"
              f"{r['speedup_vs_hf'] or '-':>7}{r['compute_floor_s']:>9}"
              f"{r['fraction_of_floor']:>10.0%}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": str(date.today()), "machine": platform.node(),
                                         "gemm_gflops": rate, "load_average": load,
                                         "cpu_linear": resolve_cpu_linear(args.cpu_linear),
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
