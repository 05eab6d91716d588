"""Where a decode step's time goes: kernel times of one CUDA-graph replay, grouped by kind.

Builds the engine on a dummy shape (llama-3-8b by default), brings `batch` requests of
`context` prompt tokens to their decode phase, then profiles graph replays of that batch with
torch.profiler and prints, per kernel kind (matmul, attention, norm, rotary/store, activation,
other), the summed GPU time per step and, for the matmuls, their share of the weight-read floor.

    PYTHONPATH=. python3 bench/gpu_profile.py --batch 1 256 --out profile.json

--ops fused unfused profiles the same steps twice, each on a fresh engine: with the batch-1
fusions of kernels.fused_gemv and kernels.fused_qkv (the CUDA path's ops) and without them (an
A/B in one run; the unfused set exists only here, see unfused_ops).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from common.models import ops_triton
from common.models.ops import (
    ModelOps,
    compose_act_linear,
    compose_norm_linear,
    compose_norm_qkv_rotary_store,
)
from kernels import norm_act

KINDS = (("attention", ("decode", "extend", "attn")), ("rotary/store", ("rotary", "store")),
         ("norm", ("rms", "norm")), ("activation", ("silu", "act")),
         ("matmul", ("gemm", "gemv", "sm90", "cutlass", "cublas", "nvjet", "xmma")),
         ("sampling", ("argmax", "reduce", "max")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profile_batch(engine: LLMEngine, batch: int, context: int, reps: int) -> dict:
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", [rng.randrange(1000, vocab - 1)
                                             for _ in range(context)], params)
    started: set[str] = set()
    while len(started) < batch:  # until every request decodes, then a few more steps
        started.update(o.request_id for o in engine.step())
    for _ in range(3):
        engine.step()
    runner = engine.runner
    bucket = runner.bucket_for(batch)
    graph = runner.graphs[bucket].graph
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    names: dict[str, float] = defaultdict(float)
    count = 0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            us = evt.device_time / reps
            totals[kind_of(evt.name)] += us
            names[evt.name[:90]] += us
            count += 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    replay_us = start.elapsed_time(end) * 1e3 / reps
    steps = profile_steps(engine, set(names), reps)
    while engine.has_unfinished():
        engine.step()
    model = engine.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)
    if model.lm_head is not None:  # the embedding is looked up, not read whole
        weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return {"batch": batch, "bucket": bucket, "context": context, "replay_us": replay_us,
            "kernels_per_step": count / reps, "kernel_us_by_kind": dict(totals),
            "kernel_us_sum": sum(totals.values()),
            "top_kernels_us": dict(sorted(names.items(), key=lambda kv: -kv[1])[:15]),
            "matrix_weight_bytes": weight_bytes, "engine_steps": steps}


def profile_steps(engine: LLMEngine, graph_kernels: set[str], reps: int) -> dict:
    """The GPU work of `reps` engine steps around the graph replays: per step, the device
    timeline's span (first op start to last op end, over the steps) against the busy time, and
    the ops that are not the graph's kernels (uploads, placeholder fills, sampling, copies)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            engine.step()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t) / reps * 1e6
    spans = [(e.time_range.start, e.time_range.end, e.name[:90]) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    if not spans:
        return {}
    spans.sort()
    busy = sum(end - start for start, end, _ in spans) / reps
    span = (max(end for _, end, _ in spans) - spans[0][0]) / reps
    outside: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for start, end, name in spans:
        if name not in graph_kernels:
            outside[name][0] += 1 / reps
            outside[name][1] += (end - start) / reps
    return {"wall_us": wall_us, "device_span_us": span, "device_busy_us": busy,
            "device_idle_us": span - busy,
            "outside_graph": {k: {"count": round(c, 2), "us": us} for k, (c, us) in
                              sorted(outside.items(), key=lambda kv: -kv[1][1])}}


def profile_ttft(engine: LLMEngine, cached: int, new: int, reps: int) -> dict:
    """GPU kernels of a prompt whose first `cached` tokens are in the prefix cache (T6)."""
    rng = random.Random(9)
    vocab = engine.model_config.vocab_size
    shared = [rng.randrange(1000, vocab - 1) for _ in range(cached)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(rid: str) -> None:
        engine.add_request(rid, shared + [rng.randrange(1000, vocab - 1) for _ in range(new)],
                           params)
        while engine.has_unfinished():
            engine.step()

    ttft("warm0")
    ttft("warm1")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            ttft(f"t{i}")
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    names: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[kind_of(evt.name)] += evt.device_time / reps
            names[evt.name[:90]] += evt.device_time / reps
    t = time.perf_counter()
    for i in range(reps):
        ttft(f"w{i}")
    wall_us = (time.perf_counter() - t) / reps * 1e6
    return {"cached": cached, "new": new, "wall_us": wall_us,
            "kernel_us_sum": sum(totals.values()), "kernel_us_by_kind": dict(totals),
            "top_kernels_us": dict(sorted(names.items(), key=lambda kv: -kv[1])[:12]),
            "runner_steps": dict(engine.runner.steps)}


def print_kernels(r: dict) -> None:
    for kind, us in sorted(r["kernel_us_by_kind"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:14s} {us:9.1f} us")
    for name, us in list(r["top_kernels_us"].items())[:8]:
        print(f"    {us:9.1f} us  {name}")


def unfused_ops() -> ModelOps:
    """The CUDA path's ops without the batch-1 fusions (kernels.fused_gemv, kernels.fused_qkv):
    at every batch size each norm, activation, GEMV and rotary/store is a launch of its own,
    as the fused set runs them with more rows."""
    norm_linear = compose_norm_linear(norm_act.rms_norm, ops_triton.linear)
    return dataclasses.replace(
        ops_triton.TRITON_OPS, norm_linear=norm_linear,
        act_linear=compose_act_linear(norm_act.silu_and_mul, ops_triton.linear),
        norm_qkv_rotary_store=compose_norm_qkv_rotary_store(norm_linear,
                                                            ops_triton.rotary_store))


def profile_variant(args: argparse.Namespace, variant: str, ttft: bool) -> list[dict]:
    fused = ops_triton.TRITON_OPS
    # CudaGraphRunner installs ops_triton.TRITON_OPS when the engine is built and captures its
    # graphs with them: the unfused set stands in for it until then.
    ops_triton.TRITON_OPS = fused if variant == "fused" else unfused_ops()
    try:
        engine = LLMEngine(build(EngineConfig,
            model=f"dummy:{args.shape}", dtype="bfloat16", device="cuda", num_kv_blocks=12000,
            max_num_seqs=max(args.batch), max_num_batched_tokens=8192, max_model_len=2048))
    finally:
        ops_triton.TRITON_OPS = fused
    results = []
    for b in args.batch:
        r = profile_batch(engine, b, args.context, args.reps)
        r["ops"] = variant
        results.append(r)
        floor_us = r["matrix_weight_bytes"] / (args.copy_tb_s * 1e12) * 1e6
        print(f"[{variant}] batch {b}: replay {r['replay_us']:.0f} us, kernels "
              f"{r['kernel_us_sum']:.0f} us in {r['kernels_per_step']:.0f} launches; "
              f"weight-read floor {floor_us:.0f} us")
        print_kernels(r)
        st = r["engine_steps"]
        if st:
            print(f"  engine step: wall {st['wall_us']:.0f} us, device span {st['device_span_us']:.0f}"
                  f" us, busy {st['device_busy_us']:.0f}, idle {st['device_idle_us']:.0f}")
            for name, v in list(st["outside_graph"].items())[:10]:
                print(f"    outside the graph: {v['count']:4.1f} x {v['us']:7.1f} us  {name}")
    if ttft:
        r = profile_ttft(engine, 500, 100, args.reps)
        r["ops"] = variant
        results.append(r)
        print(f"[{variant}] TTFT {r['cached']} cached + {r['new']} new: wall "
              f"{r['wall_us']:.0f} us, kernels {r['kernel_us_sum']:.0f} us")
        print_kernels(r)
    del engine
    torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--copy-tb-s", type=float, default=4.27, help="measured copy bandwidth")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ops", nargs="+", choices=["fused", "unfused"], default=["fused"],
                    help="the CUDA path's ops, or those without the batch-1 fusions")
    ap.add_argument("--no-ttft", action="store_true", help="skip the prefix-cached TTFT profile")
    args = ap.parse_args()
    results = []
    for variant in args.ops:
        results += profile_variant(args, variant, ttft=not args.no_ttft and variant == args.ops[0])
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
