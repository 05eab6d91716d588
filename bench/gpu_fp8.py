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
              contexts >= 1k and batch >= 32); the fp8 pool with its default launch (read as
              16-bit pairs since the thirteenth session) and read byte-wise with V widened
              before and after shared memory (DecodeConfig.widen_v_first)
  norm/act    at M = 1 the fused GEMVs; at M = 256 the norm / activation quantizing its own
              output before _scaled_mm, beside the same ops in turn

`--sweep [gemv|decode]` times launch configurations instead: the batch-1 GEMVs on fp8 weights
(skinny o, norm + gate|up, act + down, fused qkv; the weights rotate over > L2) and the decode
kernel on an fp8 pool. `--engine` then profiles the engine's batch-1 step (fp8 weights and KV)
with the default GEMV configs and with the sweep's best per projection.

Times are CUDA-graph replays of back-to-back calls (bench/gpu_kernels.py's helpers; decode
rotates its block tables over several times the L2).
Usage: PYTHONPATH=. python3 bench/gpu_fp8.py --out fp8.json
"""

from __future__ import annotations

import argparse
import contextlib
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
                if label != "fp8" and label != "bf16":  # byte-wise, V widened before / after
                    cfg = dataclasses.replace(cfg, widen_v_first=label == "fp8_v_first",
                                              fp8_pairs=False, prefetch_table=False,
                                              max_registers=None)
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


# Batch-1 launch configurations on fp8 weights (block_n, block_k, warps, stages, vec, mma_rows):
# the tile accumulator (vec 1), in-thread partial sums (vec 16) and the tensor cores on fp16
# hi / lo rows of x (mma_rows), skinny_gemm's module docstring.
GEMV_CONFIGS = [SkinnyConfig(1, bn, bk, 1, w, st, vec, mma) for bn, bk, w, st, vec, mma in (
    (16, 512, 4, 4, 1, 0), (16, 1024, 4, 4, 1, 0),
    (64, 256, 4, 3, 16, 0), (32, 512, 4, 3, 16, 0), (16, 2048, 4, 3, 16, 0),
    (16, 1024, 2, 3, 16, 0), (16, 1024, 4, 4, 16, 0), (32, 1024, 4, 3, 16, 0),
    (128, 128, 4, 3, 1, 16), (64, 256, 4, 3, 1, 16), (32, 256, 4, 3, 1, 16),
    (32, 512, 4, 3, 1, 16), (64, 128, 4, 4, 1, 16), (16, 512, 4, 3, 1, 16),
    (128, 128, 4, 3, 1, 64))]
# fused qkv: a program's pairs are block_n / 2, at most head_dim / 2 (64), and at least 16 on
# the tensor cores.
QKV_CONFIGS = [SkinnyConfig(1, bn, bk, 1, w, st, vec, mma) for bn, bk, w, st, vec, mma in (
    (16, 512, 4, 3, 1, 0), (32, 512, 4, 3, 16, 0), (64, 256, 4, 3, 16, 0),
    (16, 2048, 4, 3, 16, 0), (32, 256, 4, 3, 1, 16), (64, 128, 4, 3, 1, 16),
    (64, 256, 4, 3, 1, 16), (128, 128, 4, 3, 1, 16), (32, 512, 4, 3, 1, 16))]
L2_DEFEAT_BYTES = 256 << 20   # weight copies a sweep rotates over (the H200's L2: 60 MB)


def gemv_sweep(copy_tb_s: float) -> list[dict]:
    """Each batch-1 kernel on fp8 weights of the 8B shapes, over GEMV_CONFIGS / QKV_CONFIGS
    (and the default, None): the time and the weight stream's fraction of the copy bandwidth.
    The calls of a timed graph rotate over copies of the weight (>= 256 MB in all), so the
    weight comes from DRAM as in the engine (a 17-59 MB weight read again stays in L2)."""
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in (("o", PROJECTIONS["o"]), ("gate_up", PROJECTIONS["gate_up"]),
                         ("down", PROJECTIONS["down"]), ("qkv", PROJECTIONS["qkv"])):
        w8 = quantize_weight((torch.randn(n, k, device=dev) * k ** -0.5).to(BF16))
        copies = [w8.qweight] + [w8.qweight.clone()
                                 for _ in range(max(0, -(-L2_DEFEAT_BYTES // (n * k)) - 1))]
        s = w8.scale
        ref_w = torch_ops.dequantize_rows(w8.qweight, s, BF16)
        h, res = (torch.randn(1, k, device=dev, dtype=BF16) for _ in range(2))
        g = (1 + 0.1 * torch.randn(k, device=dev)).to(BF16)
        gate_up = torch.randn(1, 2 * k, device=dev, dtype=BF16)
        kc, vc = (torch.zeros(64, 16, 8, 128, device=dev, dtype=FP8) for _ in range(2))
        pos, slot = torch.tensor([100], device=dev), torch.tensor([5], device=dev)
        cos_sin = torch.randn(4096, 128, device=dev)
        turn = [0]

        def call(cfg, q=None, s=s, name=name, h=h, res=res, g=g, gate_up=gate_up, kc=kc, vc=vc,
                 pos=pos, slot=slot, cos_sin=cos_sin, copies=copies, turn=turn):
            if q is None:   # the next copy of the fp8 weight
                q = copies[turn[0] % len(copies)]
                turn[0] += 1
            if name == "o":
                return skinny_gemm.skinny_linear(h, q, None, weight_scale=s, config=cfg)
            if name == "gate_up":
                return fused_gemv.norm_linear(h, res, g, 1e-5, q, None, weight_scale=s,
                                              config=cfg)[0]
            if name == "down":
                return fused_gemv.act_linear(gate_up, q, None, weight_scale=s, config=cfg)
            return fused_qkv.norm_qkv_rotary_store(h, res, g, 1e-5, q, None, pos, cos_sin, kc,
                                                   vc, slot, 32, config=cfg, weight_scale=s)[0]

        want = call(None, ref_w, None).float()   # the bf16 kernel on the dequantized weight
        timed = []
        for cfg in [None, *(QKV_CONFIGS if name == "qkv" else GEMV_CONFIGS)]:
            try:
                err = ((call(cfg, w8.qweight).float() - want).norm() / want.norm()).item()
                us = graphed_ms(lambda cfg=cfg: call(cfg)) * 1e3
            except Exception as e:  # a config the kernel refuses (or runs out of resources)
                print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            timed.append({"proj": name, "n": n, "k": k,
                          "config": None if cfg is None else cfg._asdict(), "us": us,
                          "frac_copy": (n * k + 4 * n) / (us * 1e-6) / (copy_tb_s * 1e12),
                          "rel_err_vs_bf16_kernel": err})
            c = cfg and (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.vec,
                         cfg.mma_rows)
            print(f"  gemv fp8 {name:>8} {str(c):28s} {us:7.2f} us "
                  f"({timed[-1]['frac_copy']:.2f} of copy) err {err:.1e}", flush=True)
        ok = [r for r in timed if r["rel_err_vs_bf16_kernel"] < 1e-2]
        best = min(ok, key=lambda r: r["us"])
        default = next(r for r in timed if r["config"] is None)
        print(f"gemv fp8 {name:>8}: default {default['us']:.1f} us "
              f"({default['frac_copy']:.2f}); best {best['us']:.1f} us "
              f"({best['frac_copy']:.2f}) {best['config']}", flush=True)
        rows += timed
        del copies
        torch.cuda.empty_cache()
    return rows


def best_gemv_configs(rows: list[dict]) -> dict[tuple[int, int], SkinnyConfig]:
    """(n, k) -> the sweep's fastest config (within 1e-2 of the bf16 kernel's output), where it
    beats the default."""
    best: dict[tuple[int, int], dict] = {}
    for r in rows:
        if r["rel_err_vs_bf16_kernel"] >= 1e-2:
            continue
        key = (r["n"], r["k"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return {key: SkinnyConfig(**r["config"]) for key, r in best.items()
            if r["config"] is not None}


@contextlib.contextmanager
def gemv_configs(configs: dict[tuple[int, int], SkinnyConfig] | None):
    """While open, the batch-1 fp8 GEMVs of a weight [n, k] in `configs` launch with its config
    (skinny_gemm.default_config and fused_qkv.qkv_config answer it) instead of the default."""
    orig_default, orig_qkv = skinny_gemm.default_config, fused_qkv.qkv_config
    configs = configs or {}

    def patched_default(n, k, m, num_sms=skinny_gemm.H200_SMS, *, fp8=False):
        if fp8 and m == 1 and (n, k) in configs:
            return configs[(n, k)]
        return orig_default(n, k, m, num_sms, fp8=fp8)

    def patched_qkv(n, k, num_sms, fp8=False):
        return configs[(n, k)] if fp8 and (n, k) in configs else orig_qkv(n, k, num_sms, fp8)

    skinny_gemm.default_config = fused_gemv.default_config = patched_default
    fused_qkv.qkv_config = patched_qkv
    try:
        yield
    finally:
        skinny_gemm.default_config = fused_gemv.default_config = orig_default
        fused_qkv.qkv_config = orig_qkv


def load_gemv_configs(path: Path) -> dict[tuple[int, int], SkinnyConfig]:
    """The configs a `--sweep gemv --engine` run chose (its JSON's engine_batch1_configs)."""
    table = json.loads(path.read_text()).get("engine_batch1_configs", {})
    return {tuple(int(v) for v in key.split("x")): SkinnyConfig(**cfg)
            for key, cfg in table.items()}


def engine_batch1(configs: dict[tuple[int, int], SkinnyConfig] | None) -> list[dict]:
    """One batch-1 decode step of the llama-3-8b engine with fp8 weights and an fp8 KV cache
    (bench/gpu_profile.py's profile_batch: graph replay and its kernels by kind), with the
    default GEMV configs and, when given, with `configs` put in their place (the engine's
    graphs are captured with whichever default_config / qkv_config answers)."""
    from gpu_profile import profile_batch

    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.flags import build

    results = []
    for variant in ["default"] + (["swept"] if configs else []):
        with gemv_configs(configs if variant == "swept" else None):
            engine = LLMEngine(build(EngineConfig, model="dummy:llama-3-8b", dtype="bfloat16",
                                     device="cuda", num_kv_blocks=4000, max_num_seqs=1,
                                     max_num_batched_tokens=2048, max_model_len=2048,
                                     quantization="fp8", kv_cache_dtype="fp8"))
            r = profile_batch(engine, 1, 576, 20)
        r["variant"] = variant
        results.append(r)
        print(f"engine batch 1 [{variant}]: replay {r['replay_us']:.0f} us, kernels "
              f"{r['kernel_us_sum']:.0f} us in {r['kernels_per_step']:.0f} launches", flush=True)
        for kind, us in sorted(r["kernel_us_by_kind"].items(), key=lambda kv: -kv[1]):
            print(f"    {kind:14s} {us:8.1f} us")
        for kname, us in list(r["top_kernels_us"].items())[:10]:
            print(f"    {us:8.1f} us  {kname}")
        del engine
        torch.cuda.empty_cache()
    return results


def decode_sweep(copy_tb_s: float) -> list[dict]:
    rows = []
    for batch, ctx in ((32, 1024), (32, 4096), (128, 4096), (256, 1024)):
        case = Fp8DecodeCase(batch, ctx)
        # the byte-wise read's launches (fp8_pairs off; base: for_batch's for that read)
        base = dataclasses.replace(DecodeConfig.for_batch(batch, KVH, torch.device("cuda"),
                                                          fp8=True), fp8_pairs=False,
                                   prefetch_table=False, max_registers=None)
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
    ap.add_argument("--engine", action="store_true",
                    help="then profile the engine's batch-1 fp8 step with the default GEMV "
                         "configs and with the gemv sweep's best (bench/gpu_profile.py)")
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
    if args.engine:
        swept = result.get("gemv_sweep")
        configs = best_gemv_configs(swept) if isinstance(swept, list) else None
        result["engine_batch1_configs"] = {f"{n}x{k}": c._asdict()
                                           for (n, k), c in (configs or {}).items()}
        try:
            result["engine_batch1"] = engine_batch1(configs)
        except Exception as e:
            import traceback
            traceback.print_exc()
            result["engine_batch1"] = {"error": f"{type(e).__name__}: {e}"}
    result["seconds"] = time.monotonic() - t0
    args.out.write_text(json.dumps(result, indent=1))
    print(f"done in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
