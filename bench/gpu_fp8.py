"""FP8 on the GPU, kernel by kernel, against bf16 in the same run (issue 19), llama-3-8b shapes.

  ceilings    copy bandwidth (bytes read + written), bf16 and fp8 (row-wise scaled) matmul
              rates at 8192^3
  projections qkv, o, gate|up and down at M = 1, 256 and 8192 rows through the CUDA ops
              (common.models.ops_triton.linear: skinny GEMV at M = 1, else cuBLAS / per-token
              quantization + torch._scaled_mm), bf16 weight vs fp8 weight; M = 1 also through
              the fused GEMVs (norm + gate|up, act + down). Weight GB/s (weight bytes / time,
              as a fraction of the copy bandwidth) at M = 1, TFLOP/s above; the fp8 rows also
              time _scaled_mm alone (the per-token quantization's share)
  decode      paged decode attention over an fp8 pool vs a bf16 one (block size 16, 32/8 heads
              of 128): fewest bytes (K/V of every context once at its element size, q, out) /
              time, as a fraction of the copy bandwidth (the issue's target: >= 0.85 at
              contexts >= 1k and batch >= 32); the fp8 pool with its default launch and with
              V widened before and after shared memory (DecodeConfig.widen_v_first)
  norm/act    at M = 1 the fused GEMVs; at M = 256 the norm / activation quantizing its own
              output before _scaled_mm, beside the same ops in turn

`--sweep [gemv|decode]` times launch configurations instead: the batch-1 GEMVs on fp8 weights
(skinny o, norm + gate|up, act + down, fused qkv) and the decode kernel on an fp8 pool.

Times are CUDA-graph replays of back-to-back calls (bench/gpu_kernels.py's helpers; decode
rotates its block tables over several times the L2).
Usage: PYTHONPATH=. python3 bench/gpu_fp8.py --out fp8.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from common.models.fp8 import quantize_weight
from common.models.ops_triton import (
    _act_linear_in_turn,
    _norm_linear_in_turn,
    act_linear,
    linear,
    norm_linear,
)
from kernels import fp8_linear, fused_gemv, fused_qkv, skinny_gemm, torch_ops
from kernels.decode_attention import DecodeConfig, default_num_splits
from kernels.skinny_gemm import SkinnyConfig

sys.path.insert(0, str(Path(__file__).parent))
from gpu_kernels import KVH, D, DecodeCase, copy_bandwidth, graphed_ms  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
HIDDEN, INTER = 4096, 14336
PROJECTIONS = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
               "down": (HIDDEN, INTER)}


def matmul_rates() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    b = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    a8, b8 = a.to(FP8), b.to(FP8)
    sa, sb = torch.ones(8192, 1, device="cuda"), torch.ones(1, 8192, device="cuda")
    flop = 2 * 8192 ** 3
    bf = do_bench(lambda: a @ b, warmup=10, rep=50, return_mode="median")
    f8 = do_bench(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=BF16),
                  warmup=10, rep=50, return_mode="median")
    return {"bf16_tflops": flop / bf / 1e9, "fp8_tflops": flop / f8 / 1e9}


def projections(copy_tb_s: float) -> list[dict]:
    rows = []
    for name, (n, k) in PROJECTIONS.items():
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(BF16)
        w8 = quantize_weight(w)
        for m in (1, 256, 8192):
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            row = {"proj": name, "n": n, "k": k, "m": m}
            for label, weight, nbytes in (("bf16", w, 2 * n * k), ("fp8", w8, n * k + 4 * n)):
                us = graphed_ms(lambda x=x, weight=weight: linear(x, weight, None),
                                calls=20 if m < 8192 else 3) * 1e3
                row[f"{label}_us"] = us
                if m == 1:
                    row[f"{label}_frac_copy"] = nbytes / (us * 1e-6) / (copy_tb_s * 1e12)
                else:
                    row[f"{label}_tflops"] = 2 * m * n * k / (us * 1e-6) / 1e12
            if m > 1:
                xq, xs = fp8_linear.quantize_per_token(x)
                sb = w8.scale.view(1, n)
                row["fp8_scaled_mm_only_us"] = graphed_ms(
                    lambda xq=xq, xs=xs, sb=sb, q=w8.qweight: torch._scaled_mm(
                        xq, q.t(), scale_a=xs, scale_b=sb, out_dtype=BF16),
                    calls=20 if m < 8192 else 3) * 1e3
                ref = torch_ops.fp8_linear(x.float(), w8.qweight, w8.scale)
                got = linear(x, w8, None).float()
                row["fp8_rel_err_vs_w8a8_reference"] = ((got - ref).norm() / ref.norm()).item()
            row["speedup"] = row["bf16_us"] / row["fp8_us"]
            rows.append(row)
            print(f"{name:>8} M={m:<5} bf16 {row['bf16_us']:9.1f} us  fp8 {row['fp8_us']:9.1f} us"
                  f"  x{row['speedup']:.2f}  "
                  + (f"weight stream {row['bf16_frac_copy']:.2f} / {row['fp8_frac_copy']:.2f} "
                     "of copy" if m == 1 else
                     f"{row['bf16_tflops']:.0f} / {row['fp8_tflops']:.0f} TFLOP/s "
                     f"(_scaled_mm alone {row['fp8_scaled_mm_only_us']:.1f} us)"), flush=True)
    return rows + fused_gemvs(copy_tb_s)


def fused_gemvs(copy_tb_s: float) -> list[dict]:
    """As the layer runs them: norm + gate|up, and SiLU-and-mul + down; at M = 1 the fused
    GEMVs, at M = 256 the norm / activation quantizing its own output before _scaled_mm, beside
    the same ops in turn (norm, then linear with its own quantization launch)."""
    rows = []
    for name, (n, k) in (("norm+gate_up", PROJECTIONS["gate_up"]),
                         ("act+down", PROJECTIONS["down"])):
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(BF16)
        w8 = quantize_weight(w)
        g = torch.ones(k, device="cuda", dtype=BF16)
        for m in (1, 256):
            h, res = (torch.randn(m, k, device="cuda", dtype=BF16) for _ in range(2))
            gate_up = torch.randn(m, 2 * k, device="cuda", dtype=BF16)
            row = {"proj": name, "n": n, "k": k, "m": m}
            variants = [("bf16", w, norm_linear, act_linear), ("fp8", w8, norm_linear, act_linear)]
            if m > 1:
                variants.append(("fp8_in_turn", w8, _norm_linear_in_turn, _act_linear_in_turn))
            for label, weight, nl, al in variants:
                if name == "act+down":
                    def fn(weight=weight, gate_up=gate_up, al=al):
                        return al(gate_up, weight, None)
                else:
                    def fn(weight=weight, h=h, res=res, nl=nl, g=g):
                        return nl(h, res, g, 1e-5, weight, None)
                us = graphed_ms(fn) * 1e3
                row[f"{label}_us"] = us
                nbytes = 2 * n * k if label == "bf16" else n * k + 4 * n
                row[f"{label}_frac_copy"] = nbytes / (us * 1e-6) / (copy_tb_s * 1e12)
            row["speedup"] = row["bf16_us"] / row["fp8_us"]
            rows.append(row)
            extra = (f"  in turn {row['fp8_in_turn_us']:7.1f} us" if m > 1 else "")
            print(f"{name:>12} M={m:<3} bf16 {row['bf16_us']:7.1f} us ({row['bf16_frac_copy']:.2f} "
                  f"of copy)  fp8 {row['fp8_us']:7.1f} us ({row['fp8_frac_copy']:.2f})  "
                  f"x{row['speedup']:.2f}{extra}", flush=True)
    return rows


class Fp8DecodeCase(DecodeCase):
    """gpu_kernels.DecodeCase with its pools in e4m3: the K/V bytes are one per element."""

    def __init__(self, batch: int, ctx: int) -> None:
        super().__init__(batch, ctx)
        self.k = torch_ops.to_fp8(self.k)
        self.v = torch_ops.to_fp8(self.v)
        torch.cuda.empty_cache()
        self.bytes = 2 * batch * ctx * KVH * D * 1 + 2 * batch * 32 * D * 2


def decode(copy_tb_s: float) -> list[dict]:
    rows = []
    for batch in (32, 128, 256):
        for ctx in (1024, 4096):
            row = {"batch": batch, "ctx": ctx}
            for label, cls in (("bf16", DecodeCase), ("fp8", Fp8DecodeCase),
                               ("fp8_v_first", Fp8DecodeCase), ("fp8_v_late", Fp8DecodeCase)):
                case = cls(batch, ctx)
                cfg = DecodeConfig.for_batch(batch, KVH, torch.device("cuda"), label != "bf16")
                if label != "fp8" and label != "bf16":  # V widened before / after shared memory
                    cfg = dataclasses.replace(cfg, widen_v_first=label == "fp8_v_first")
                splits = default_num_splits(batch, KVH, ctx, torch.device("cuda"), cfg)
                t = case.time(splits, cfg, eager=False)
                row[f"{label}_us"] = t["us"]
                row[f"{label}_frac_copy"] = t["tb_s"] / copy_tb_s
                row[f"{label}_rel_err"] = case.rel_err(splits, cfg)
                del case
                torch.cuda.empty_cache()
            row["speedup"] = row["bf16_us"] / row["fp8_us"]
            rows.append(row)
            print(f"decode B={batch:<4} ctx={ctx:<5} bf16 {row['bf16_us']:8.1f} us "
                  f"({row['bf16_frac_copy']:.2f} of copy)  fp8 {row['fp8_us']:8.1f} us "
                  f"({row['fp8_frac_copy']:.2f})  x{row['speedup']:.2f}  V widened late "
                  f"{row['fp8_v_late_us']:.1f} us ({row['fp8_v_late_frac_copy']:.2f})",
                  flush=True)
    return rows


GEMV_CONFIGS = [SkinnyConfig(1, bn, bk, 1, w, st) for bn, bk, w, st in itertools.product(
    (8, 16, 32), (512, 1024), (4, 8), (3, 4))]


def gemv_sweep(copy_tb_s: float) -> list[dict]:
    """Each batch-1 kernel on fp8 weights of the 8B shapes, over GEMV_CONFIGS (and the
    default, None): the time and the weight stream's fraction of the copy bandwidth."""
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in (("o", PROJECTIONS["o"]), ("gate_up", PROJECTIONS["gate_up"]),
                         ("down", PROJECTIONS["down"]), ("qkv", PROJECTIONS["qkv"])):
        w8 = quantize_weight((torch.randn(n, k, device=dev) * k ** -0.5).to(BF16))
        q, s = w8.qweight, w8.scale
        h, res = (torch.randn(1, k, device=dev, dtype=BF16) for _ in range(2))
        g = torch.ones(k, device=dev, dtype=BF16)
        gate_up = torch.randn(1, 2 * k, device=dev, dtype=BF16)
        kc, vc = (torch.zeros(64, 16, 8, 128, device=dev, dtype=BF16) for _ in range(2))
        pos, slot = torch.tensor([100], device=dev), torch.tensor([5], device=dev)
        cos_sin = torch.randn(4096, 128, device=dev)

        def call(cfg, name=name, q=q, s=s, h=h, res=res, g=g, gate_up=gate_up, kc=kc, vc=vc,
                 pos=pos, slot=slot, cos_sin=cos_sin):
            if name == "o":
                return skinny_gemm.skinny_linear(h, q, None, weight_scale=s, config=cfg)
            if name == "gate_up":
                return fused_gemv.norm_linear(h, res, g, 1e-5, q, None, weight_scale=s,
                                              config=cfg)
            if name == "down":
                return fused_gemv.act_linear(gate_up, q, None, weight_scale=s, config=cfg)
            return fused_qkv.norm_qkv_rotary_store(h, res, g, 1e-5, q, None, pos, cos_sin, kc,
                                                   vc, slot, 32, config=cfg, weight_scale=s)

        timed = []
        for cfg in [None, *GEMV_CONFIGS]:
            try:
                us = graphed_ms(lambda cfg=cfg: call(cfg)) * 1e3
            except Exception as e:  # a config the kernel refuses (or runs out of registers)
                print(f"{name} {cfg}: {type(e).__name__}")
                continue
            timed.append({"proj": name, "config": None if cfg is None else cfg._asdict(),
                          "us": us, "frac_copy": (n * k + 4 * n) / (us * 1e-6)
                          / (copy_tb_s * 1e12)})
        best = min(timed, key=lambda r: r["us"])
        default = next(r for r in timed if r["config"] is None)
        print(f"gemv fp8 {name:>8}: default {default['us']:.1f} us "
              f"({default['frac_copy']:.2f}); best {best['us']:.1f} us "
              f"({best['frac_copy']:.2f}) {best['config']}", flush=True)
        rows += timed
    return rows


def decode_sweep(copy_tb_s: float) -> list[dict]:
    rows = []
    for batch, ctx in ((32, 1024), (32, 4096), (128, 4096), (256, 1024)):
        case = Fp8DecodeCase(batch, ctx)
        base = DecodeConfig.for_batch(batch, KVH, torch.device("cuda"), fp8=True)
        timed = []
        for bn, w, st, first in itertools.product((64, 128), (4, 8), (2, 3), (True, False)):
            cfg = DecodeConfig(bn, w, st, base.waves, base.fused_merge, first)
            splits = default_num_splits(batch, KVH, ctx, torch.device("cuda"), cfg)
            try:
                t = case.time(splits, cfg, reps=1, eager=False)
            except Exception as e:
                print(f"decode {cfg}: {type(e).__name__}")
                continue
            timed.append({"batch": batch, "ctx": ctx, "config": [bn, w, st, first],
                          "us": t["us"],
                          "frac_copy": t["tb_s"] / copy_tb_s, "default": cfg == base})
        best = min(timed, key=lambda r: r["us"])
        default = next((r for r in timed if r["default"]), None)
        print(f"decode fp8 B={batch} ctx={ctx}: default "
              f"{default['frac_copy'] if default else float('nan'):.2f} of copy; best "
              f"{best['us']:.1f} us ({best['frac_copy']:.2f}) block_n, warps, stages, V first "
              f"{best['config']}", flush=True)
        rows += timed
        del case
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sweep", nargs="?", const="gemv,decode", default="",
                    help="time launch configurations instead (gemv, decode or both)")
    args = ap.parse_args()
    t0 = time.monotonic()
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["copy"] = copy_bandwidth()
    result["matmul"] = matmul_rates()
    copy_tb_s = result["copy"]["tb_s"]
    print(f"copy {copy_tb_s:.2f} TB/s; matmul bf16 {result['matmul']['bf16_tflops']:.0f}, "
          f"fp8 {result['matmul']['fp8_tflops']:.0f} TFLOP/s", flush=True)
    sweeps = {"gemv": ("gemv_sweep", gemv_sweep), "decode": ("decode_sweep", decode_sweep)}
    parts = ([sweeps[name] for name in args.sweep.split(",")] if args.sweep
             else (("projections", projections), ("decode", decode)))
    for name, fn in parts:
        try:
            result[name] = fn(copy_tb_s)
        except Exception as e:  # the other section's numbers still count
            import traceback
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        args.out.write_text(json.dumps(result, indent=1))
    result["seconds"] = time.monotonic() - t0
    args.out.write_text(json.dumps(result, indent=1))
    print(f"done in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
