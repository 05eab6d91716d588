"""The decode step's matmuls alone: each projection of a dummy shape at the batch sizes the
engine runs, through each BLAS library torch offers, against the roofline.

For every (projection, rows M) it times F.linear(x[M, K], W[N, K]) in a CUDA graph of back-to-
back calls that rotate over enough weight copies to defeat the L2, and reports the time, the
bandwidth (weight bytes / time), the FLOP rate and the fraction of the roofline floor
max(weight bytes / copy bandwidth, FLOPs / matmul rate), for torch's default library and for
each library `torch.backends.cuda.preferred_blas_library` accepts.

    PYTHONPATH=. python3 bench/gpu_matmul.py --out matmul.json

With --skinny it times kernels.skinny_gemm.skinny_linear instead, for a few candidate configs
per (projection, M) next to F.linear (torch's default library), each as a fraction of the same
floor, and names the fastest config of each (rows default to 1 4 16; about a minute on an H200):

    PYTHONPATH=. python3 bench/gpu_matmul.py --skinny --out skinny.json

With --fused it times the batch-1 GEMVs that kernels.fused_gemv fuses (qkv and gate_up with the
norm on their input, down with SiLU-and-mul) for a few configs, next to the plain skinny GEMV of
the same weight:

    PYTHONPATH=. python3 bench/gpu_matmul.py --fused --out fused.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from common.models.dummy import dummy_config
from kernels.fused_gemv import act_linear, norm_linear
from kernels.fused_qkv import norm_qkv_rotary_store, qkv_config
from kernels.skinny_gemm import MAX_M, SkinnyConfig, default_config, skinny_linear

LIBRARIES = ("default", "cublas", "cublaslt")


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the weight, as the engine fuses them."""
    c = dummy_config(shape)
    return {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o": (c.hidden_size, c.q_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}


def time_linear(n: int, k: int, m: int, copies: int, reps: int = 5) -> float:
    """Median microseconds of one F.linear, from graph replays of `copies` calls on distinct
    weights (so each call reads its weight from DRAM)."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return time_calls(F.linear, x, weights, reps)


def time_calls(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
               weights: list[torch.Tensor], reps: int = 5) -> float:
    """Median microseconds of one fn(x, w), from graph replays of one call per weight."""
    for w in weights:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    return statistics.median(times)


def skinny_candidates(n: int, k: int, m: int, num_sms: int) -> list[SkinnyConfig]:
    """The default config first, then neighbours of it: narrower/wider rows, other split
    counts, pipeline depths and warps, and (at M == 1) the tl.dot path."""
    base = default_config(n, k, m, num_sms)
    if m == 1:
        alts = [SkinnyConfig(1, 8, 512), SkinnyConfig(1, 16, 512), SkinnyConfig(1, 16, 1024),
                SkinnyConfig(1, 32, 512, num_warps=8), SkinnyConfig(1, 16, 512, num_stages=6),
                SkinnyConfig(1, 16, 512, split_k=2), SkinnyConfig(16, 16, 256),
                SkinnyConfig(16, 32, 256)]
    else:
        bm = base.block_m
        alts = [base._replace(split_k=1), base._replace(split_k=2 * base.split_k),
                base._replace(num_stages=3), base._replace(num_stages=6),
                base._replace(num_warps=8), SkinnyConfig(bm, 16, 256), SkinnyConfig(bm, 32, 256),
                SkinnyConfig(bm, 64, 128, split_k=4)]
    return list(dict.fromkeys([base, *alts]))


def _config_name(cfg: SkinnyConfig) -> str:
    return (f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} "
            f"w{cfg.num_warps} p{cfg.num_stages}")


def bench_skinny(args: argparse.Namespace) -> dict:
    """F.linear and skinny_linear candidates per (projection, M): table rows and the best."""
    results, best = [], []
    t0 = time.monotonic()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("| proj | M | impl | config | us | TB/s | of floor | vs F.linear | rel err |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for name, (n, k) in projections(args.shape).items():
        copies = max(2, int(512e6 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(copies)]
        nbytes = n * k * 2
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            floor = max(nbytes / (args.copy_tb_s * 1e12),
                        2 * m * n * k / (args.matmul_tflops * 1e12)) * 1e6
            want = F.linear(x, weights[0]).float()
            cublas_us = time_calls(F.linear, x, weights)
            runs: list[tuple[str, SkinnyConfig | None, float, float]] = [
                ("F.linear", None, cublas_us, 0.0)]
            default = default_config(n, k, m, sms)
            for cfg in skinny_candidates(n, k, m, sms):
                def call(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig = cfg,
                         ) -> torch.Tensor:
                    return skinny_linear(x, w, config=cfg)
                got = call(x, weights[0]).float()
                err = ((got - want).norm() / want.norm()).item()
                runs.append(("skinny", cfg, time_calls(call, x, weights), err))
            for impl, cfg, us, err in runs:
                row = {"proj": name, "m": m, "n": n, "k": k, "impl": impl,
                       "config": cfg._asdict() if cfg else None,
                       "default": cfg == default, "us": us,
                       "tb_s": nbytes / us / 1e6, "of_floor": floor / us,
                       "vs_f_linear": cublas_us / us, "rel_err_vs_f_linear": err}
                results.append(row)
                label = _config_name(cfg) + (" (default)" if row["default"] else "") if cfg else "-"
                print(f"| {name} | {m} | {impl} | {label} | {us:.1f} | {row['tb_s']:.2f} | "
                      f"{row['of_floor']:.2f} | {row['vs_f_linear']:.2f} | {err:.1e} |")
            top = min((r for r in results[-len(runs):] if r["impl"] == "skinny"),
                      key=lambda r: r["us"])
            dflt = next(r for r in results[-len(runs):] if r["default"])
            best.append({"proj": name, "m": m, "best_config": top["config"],
                         "best_of_floor": top["of_floor"], "default_of_floor": dflt["of_floor"],
                         "f_linear_of_floor": floor / cublas_us})
        del weights
        torch.cuda.empty_cache()
    print("\n| proj | M | F.linear of floor | default of floor | best of floor | best config |\n"
          "|---|---|---|---|---|---|")
    for b in best:
        print(f"| {b['proj']} | {b['m']} | {b['f_linear_of_floor']:.2f} | "
              f"{b['default_of_floor']:.2f} | {b['best_of_floor']:.2f} | "
              f"{_config_name(SkinnyConfig(**b['best_config']))} |")
    print(f"\n{time.monotonic() - t0:.0f} s")
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_tb_s": args.copy_tb_s, "results": results,
            "best": best}


FUSED_CANDIDATES = [SkinnyConfig(1, 16, 512), SkinnyConfig(1, 8, 512), SkinnyConfig(1, 32, 512),
                    SkinnyConfig(1, 16, 256), SkinnyConfig(1, 16, 1024),
                    SkinnyConfig(1, 16, 512, num_stages=3), SkinnyConfig(1, 16, 512, num_stages=6),
                    SkinnyConfig(1, 16, 512, num_warps=8), SkinnyConfig(1, 32, 512, num_warps=8),
                    SkinnyConfig(1, 8, 1024, num_warps=8)]


QKV_CANDIDATES = [SkinnyConfig(1, 16, 512), SkinnyConfig(1, 16, 256, num_stages=3),
                  SkinnyConfig(1, 16, 256, num_stages=6), SkinnyConfig(1, 16, 256, num_stages=2),
                  SkinnyConfig(1, 8, 256), SkinnyConfig(1, 32, 256), SkinnyConfig(1, 16, 128),
                  SkinnyConfig(1, 16, 128, num_stages=6), SkinnyConfig(1, 16, 256, num_warps=2)]


def qkv_rotary_rows(shape: str, x: torch.Tensor, res: torch.Tensor, g: torch.Tensor,
                    weights: list[torch.Tensor], sms: int,
                    ) -> list[tuple[str, SkinnyConfig, float]]:
    """The engine's batch-1 qkv launch (kernels.fused_qkv: norm, GEMV, rotary, K/V store) for
    each candidate config (rows per program = 2 x pairs, at most head_dim)."""
    c = dummy_config(shape)
    cache = torch.zeros(4, 16, c.num_kv_heads, c.head_dim, device="cuda", dtype=x.dtype)
    positions = torch.tensor([100], device="cuda")
    slot = torch.tensor([5], device="cuda")
    cos_sin = torch.randn(2048, c.head_dim, device="cuda")
    rows = []
    for cfg in [None, *QKV_CANDIDATES]:
        def qkv(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig | None = cfg,
                ) -> torch.Tensor:
            return norm_qkv_rotary_store(x, res, g, 1e-5, w, None, positions, cos_sin, cache,
                                         cache, slot, c.num_heads, config=cfg)[0]
        used = cfg or qkv_config(*weights[0].shape, sms)
        rows.append(("qkv_rotary" + (" (default)" if cfg is None else ""), used,
                     time_calls(qkv, x, weights)))
    return rows


def bench_fused(args: argparse.Namespace) -> dict:
    """Plain skinny GEMV (default config) and fused-GEMV candidates per fused projection."""
    results = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("| proj | impl | config | us | of floor | vs plain |\n|---|---|---|---|---|---|")
    bf16 = torch.bfloat16
    for name, (n, k) in projections(args.shape).items():
        if name not in ("qkv", "gate_up", "down"):
            continue
        copies = max(2, int(512e6 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=bf16) * 0.02 for _ in range(copies)]
        floor = n * k * 2 / (args.copy_tb_s * 1e12) * 1e6
        x = torch.randn(1, k, device="cuda", dtype=bf16)
        res = torch.randn(1, k, device="cuda", dtype=bf16)
        g = torch.ones(k, device="cuda", dtype=bf16)
        gate_up = torch.randn(1, 2 * k, device="cuda", dtype=bf16)
        plain = time_calls(lambda x, w: skinny_linear(x, w), x, weights)
        rows = [("plain", default_config(n, k, 1, sms), plain)]
        for cfg in FUSED_CANDIDATES:
            if name == "down":
                def act(x: torch.Tensor, w: torch.Tensor,
                        cfg: SkinnyConfig = cfg) -> torch.Tensor:
                    return act_linear(x, w, config=cfg)
                rows.append(("fused", cfg, time_calls(act, gate_up, weights)))
            else:
                def norm(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig = cfg,
                         res: torch.Tensor = res, g: torch.Tensor = g) -> torch.Tensor:
                    return norm_linear(x, res, g, 1e-5, w, config=cfg)[0]
                rows.append(("fused", cfg, time_calls(norm, x, weights)))
        if name == "qkv":
            rows += qkv_rotary_rows(args.shape, x, res, g, weights, sms)
        for impl, cfg, us in rows:
            results.append({"proj": name, "n": n, "k": k, "impl": impl, "config": cfg._asdict(),
                            "us": us, "of_floor": floor / us, "vs_plain": plain / us})
            print(f"| {name} | {impl} | {_config_name(cfg)} | {us:.1f} | {floor / us:.2f} | "
                  f"{plain / us:.2f} |")
        del weights
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_tb_s": args.copy_tb_s, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--rows", type=int, nargs="+",
                    help="rows M (default 1 8 64 128 256; with --skinny 1 4 16)")
    ap.add_argument("--fused", action="store_true",
                    help="time the batch-1 fused GEMVs (kernels.fused_gemv) against plain ones")
    ap.add_argument("--skinny", action="store_true",
                    help="time skinny_linear configs against F.linear instead of the libraries")
    ap.add_argument("--copy-tb-s", type=float, default=4.27)
    ap.add_argument("--matmul-tflops", type=float, default=790.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.fused:
        args.out.write_text(json.dumps(bench_fused(args), indent=1))
        return
    if args.skinny:
        args.rows = args.rows or [1, 4, 16]
        if max(args.rows) > MAX_M:
            ap.error(f"--skinny: rows up to {MAX_M}")
        args.out.write_text(json.dumps(bench_skinny(args), indent=1))
        return
    args.rows = args.rows or [1, 8, 64, 128, 256]
    results = []
    print("| library | proj | M | us | TB/s | TFLOP/s | of roofline |\n|---|---|---|---|---|---|---|")
    for lib in LIBRARIES:
        if lib != "default":
            try:
                torch.backends.cuda.preferred_blas_library(lib)
            except Exception as e:  # noqa: BLE001 - a library this build lacks
                print(f"{lib}: unavailable ({e})")
                continue
        for name, (n, k) in projections(args.shape).items():
            copies = max(2, int(512e6 // (n * k * 2)))
            for m in args.rows:
                us = time_linear(n, k, m, copies)
                nbytes, flops = n * k * 2, 2 * m * n * k
                floor = max(nbytes / (args.copy_tb_s * 1e12), flops / (args.matmul_tflops * 1e12))
                row = {"library": lib, "proj": name, "m": m, "n": n, "k": k, "us": us,
                       "tb_s": nbytes / us / 1e6, "tflops": flops / us / 1e6,
                       "of_roofline": floor * 1e6 / us}
                results.append(row)
                print(f"| {lib} | {name} | {m} | {us:.1f} | {row['tb_s']:.2f} | "
                      f"{row['tflops']:.0f} | {row['of_roofline']:.2f} |")
    torch.backends.cuda.preferred_blas_library("cublas")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
