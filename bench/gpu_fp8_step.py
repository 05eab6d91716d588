"""The fp8 decode step above batch 1 on the H200 (issue 19): what torch._scaled_mm's fast
accumulation buys, where the batch-256 step (T4) spends its time, and decode attention's split
count and tile at T4's shape.

  gemm    torch._scaled_mm (row-wise scales) on the four llama-3-8b projections at M = 256, 1024
          and 8192, use_fast_accum off and on: time (CUDA-graph replays over weight copies that
          rotate past the L2), TFLOP/s, and each one's relative error against float32
          arithmetic on the same fp8 values (beside the bf16 output's rounding alone)
  tgemm   fp8_linear.scaled_mm_triton (smaller tiles than cuBLASLt's 128 x 128, which leave
          o and down at M = 256 64 tiles for 132 multiprocessors) beside _scaled_mm at M = 256
          and 1024: time and error (thirteenth session; not in the default parts)
  attn    decode attention at T4's shape (batch 256, contexts 512..768): on an fp8 pool the
          launch DecodeConfig.for_batch / default_num_splits choose (128-token tiles, one
          split) beside 64-token tiles and 2 or 4 splits with the fused merge; on a bf16 pool
          its default launch
  engine  the engine's batch-256 step (llama-3-8b, fp8 weights + fp8 KV, context ~640; bench/
          gpu_profile.py's profile_batch: graph replay and its kernels by kind), fresh engines,
          with fast accumulation and (--promoted, first) without

    PYTHONPATH=. python3 bench/gpu_fp8_step.py --out step.json [--parts gemm,attn] [--promoted]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from kernels import fp8_linear
from kernels.decode_attention import DecodeConfig, default_num_splits

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fp8 import PROJECTIONS, Fp8DecodeCase, matmul_rates  # noqa: E402
from gpu_kernels import KVH, D, DecodeCase, H, copy_bandwidth  # noqa: E402

BF16 = torch.bfloat16
L2_DEFEAT_BYTES = 256 << 20   # weight bytes a GEMM timing rotates over (the H200's L2: 60 MB)
T4_BATCH, T4_CONTEXT = 256, 640


def _graphed_rotating_ms(fns: list) -> float:
    """GPU time of one call: the calls (one per weight copy) captured back to back in a graph."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return do_bench(graph.replay, warmup=5, rep=60, return_mode="median") / len(fns)


def gemm(copy_tb_s: float) -> list[dict]:
    rows = []
    for m in (256, 1024, 8192):
        for name, (n, k) in PROJECTIONS.items():
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            xq, xs = fp8_linear.quantize_per_token(x)
            q, s = torch_quantized(n, k)
            copies = [q] + [q.clone() for _ in range(max(0, min(7, math.ceil(
                L2_DEFEAT_BYTES / (n * k)) - 1)))]
            ref = (xq.float() * xs) @ (q.float() * s[:, None]).t()
            row = {"proj": name, "m": m, "n": n, "k": k,
                   "bf16_rounding_rel_err": _rel(ref.to(BF16).float(), ref)}
            for fast in (False, True):
                key = "fast" if fast else "promoted"
                ms = _graphed_rotating_ms([functools.partial(
                    fp8_linear.fp8_linear_prequantized, xq, xs, w, s, None, BF16,
                    fast_accum=fast) for w in copies])
                row[f"{key}_us"] = ms * 1e3
                row[f"{key}_tflops"] = 2 * m * n * k / (ms * 1e-3) / 1e12
                out = fp8_linear.fp8_linear_prequantized(xq, xs, q, s, None, BF16,
                                                         fast_accum=fast)
                row[f"{key}_rel_err"] = _rel(out.float(), ref)
            row["speedup"] = row["promoted_us"] / row["fast_us"]
            rows.append(row)
            print(f"gemm {name:>8} M={m:<5} promoted {row['promoted_us']:8.1f} us "
                  f"({row['promoted_tflops']:5.0f} TFLOP/s, err {row['promoted_rel_err']:.2e})"
                  f"  fast {row['fast_us']:8.1f} us ({row['fast_tflops']:5.0f}, err "
                  f"{row['fast_rel_err']:.2e})  x{row['speedup']:.3f}  bf16 rounding "
                  f"{row['bf16_rounding_rel_err']:.2e}", flush=True)
            del x, xq, copies, ref
            torch.cuda.empty_cache()
    return rows


TGEMM_CONFIGS = {  # fp8_linear.GemmConfig: (block_m, block_n, block_k, warps, stages)
    "64x128": (64, 128, 128, 4, 4), "64x64": (64, 64, 128, 4, 5),
    "128x64": (128, 64, 128, 4, 4), "128x128": (128, 128, 128, 8, 4),
}


def tgemm(copy_tb_s: float) -> list[dict]:
    """fp8_linear.scaled_mm_triton in each of TGEMM_CONFIGS beside _scaled_mm (fast
    accumulation) on the four projections at M = 256 (T4) and 1024, weights rotating past the
    L2; errors against float32 arithmetic on the same fp8 values."""
    rows = []
    for m in (256, 1024):
        for name, (n, k) in PROJECTIONS.items():
            xq, xs = fp8_linear.quantize_per_token(torch.randn(m, k, device="cuda", dtype=BF16))
            q, s = torch_quantized(n, k)
            copies = [q] + [q.clone() for _ in range(max(0, min(7, math.ceil(
                L2_DEFEAT_BYTES / (n * k)) - 1)))]
            ref = (xq.float() * xs) @ (q.float() * s[:, None]).t()
            row = {"proj": name, "m": m, "n": n, "k": k, "cublaslt_us": 1e3 * _graphed_rotating_ms(
                [functools.partial(fp8_linear.fp8_linear_prequantized, xq, xs, w, s, None, BF16)
                 for w in copies])}
            for label, (bm, bn, bk, w, st) in TGEMM_CONFIGS.items():
                cfg = fp8_linear.GemmConfig(bm, bn, bk, 8, w, st)
                try:
                    out = fp8_linear.scaled_mm_triton(xq, xs, q, s, None, BF16, cfg)
                    us = 1e3 * _graphed_rotating_ms([functools.partial(
                        fp8_linear.scaled_mm_triton, xq, xs, c, s, None, BF16, cfg)
                        for c in copies])
                except Exception as e:  # a tile the compiler refuses: the others still count
                    print(f"  tgemm {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                row[label] = {"us": us, "rel_err": _rel(out.float(), ref),
                              "tflops": 2 * m * n * k / (us * 1e-6) / 1e12}
            rows.append(row)
            print(f"tgemm {name:>8} M={m:<5} cuBLASLt {row['cublaslt_us']:7.1f} us  " + "  ".join(
                f"{lb} {row[lb]['us']:7.1f} ({row[lb]['rel_err']:.1e})" for lb in TGEMM_CONFIGS
                if lb in row), flush=True)
            del xq, copies, ref
            torch.cuda.empty_cache()
    return rows


def torch_quantized(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from common.models.fp8 import quantize_weight
    w = quantize_weight((torch.randn(n, k, device="cuda") * k ** -0.5).to(BF16))
    return w.qweight, w.scale


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _attn_case(batch: int, ctx: int | None, fp8: bool) -> DecodeCase:
    """Pools and rotating tables of `batch` sequences: of `ctx` tokens each, or (None) of T4's
    contexts, 512..768 drawn at random."""
    case = (Fp8DecodeCase if fp8 else DecodeCase)(batch, ctx or 768)
    if ctx is None:
        gen = torch.Generator().manual_seed(4)
        lens = torch.randint(512, 769, (batch,), generator=gen, dtype=torch.int32)
        case.seq_lens.copy_(lens)
        case.bytes = int(lens.sum()) * KVH * D * 2 * (1 if fp8 else 2) + 2 * batch * H * D * 2
    return case


def attn(copy_tb_s: float) -> list[dict]:
    dev = torch.device("cuda")
    rows = []
    for fp8 in (True, False):
        case = _attn_case(T4_BATCH, None, fp8)
        base = DecodeConfig.for_batch(T4_BATCH, KVH, dev, fp8=fp8)
        splits = default_num_splits(T4_BATCH, KVH, 2048, dev, base)
        variants = [(base, splits)]
        if fp8:
            variants += [(dataclasses.replace(base, block_n=bn, fused_merge=True), n)
                         for bn in (128, 64) for n in (1, 2, 4) if (bn, n) != (base.block_n, 1)]
        for cfg, n in variants:
            t = case.time(n, cfg, reps=3, eager=False)
            row = {"pool": "fp8" if fp8 else "bf16", "block_n": cfg.block_n, "splits": n,
                   "default": (cfg, n) == (base, splits), "us": t["us"],
                   "spread_us": t["spread_us"], "frac_copy": t["tb_s"] / copy_tb_s}
            rows.append(row)
            print(f"attn {row['pool']} B={T4_BATCH} ctx 512..768: {cfg.block_n}-token tiles, {n} "
                  f"split(s){' (default)' if row['default'] else ''}: {t['us']:7.1f} us "
                  f"(+-{t['spread_us']:.1f}), {row['frac_copy']:.2f} of copy", flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def fast_accumulation(fast: bool):
    """The engine built inside captures its graphs with fast accumulation on or off."""
    orig = fp8_linear.fp8_linear_prequantized
    fp8_linear.fp8_linear_prequantized = functools.partial(orig, fast_accum=fast)
    try:
        yield
    finally:
        fp8_linear.fp8_linear_prequantized = orig


def engine(with_promoted: bool) -> list[dict]:
    from gpu_profile import profile_batch

    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.flags import build

    results = []
    for fast in ([False] if with_promoted else []) + [True]:
        label = "fast" if fast else "promoted"
        with fast_accumulation(fast):
            eng = LLMEngine(build(EngineConfig, model="dummy:llama-3-8b", dtype="bfloat16",
                                  device="cuda", num_kv_blocks=14000, max_num_seqs=T4_BATCH,
                                  max_num_batched_tokens=8192, max_model_len=2048,
                                  quantization="fp8", kv_cache_dtype="fp8"))
            r = profile_batch(eng, T4_BATCH, T4_CONTEXT, 10)
        r["variant"] = label
        results.append(r)
        st = r.get("engine_steps") or {}
        print(f"engine batch {T4_BATCH} [{label}]: replay {r['replay_us']:.0f} us, kernels "
              f"{r['kernel_us_sum']:.0f} us in {r['kernels_per_step']:.0f} launches; engine "
              f"step wall {st.get('wall_us', float('nan')):.0f} us", flush=True)
        for kind, us in sorted(r["kernel_us_by_kind"].items(), key=lambda kv: -kv[1]):
            print(f"    {kind:14s} {us:8.1f} us")
        for kname, us in r["top_kernels_us"].items():
            print(f"    {us:8.1f} us  {kname}")
        del eng
        torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="gemm,attn,engine",
                    help="comma-separated: gemm, tgemm, attn, engine")
    ap.add_argument("--promoted", action="store_true",
                    help="engine: also the step without fast accumulation")
    args = ap.parse_args()
    parts = args.parts.split(",")
    t0 = time.monotonic()
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "copy": copy_bandwidth(), "matmul": matmul_rates()}
    copy_tb_s = result["copy"]["tb_s"]
    print(f"copy {copy_tb_s:.2f} TB/s; matmul bf16 {result['matmul']['bf16_tflops']:.0f}, "
          f"fp8 (promoted) {result['matmul']['fp8_tflops']:.0f} TFLOP/s", flush=True)
    for name, fn in (("gemm", gemm), ("tgemm", tgemm), ("attn", attn),
                     ("engine", lambda _: engine(args.promoted))):
        if name not in parts:
            continue
        try:
            result[name] = fn(copy_tb_s)
        except Exception as e:  # the other parts' numbers still count
            import traceback
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        args.out.write_text(json.dumps(result, indent=1))
    result["seconds"] = time.monotonic() - t0
    args.out.write_text(json.dumps(result, indent=1))
    print(f"done in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
