"""Where the fp8-pool decode attention's time goes (issue 19), H200, llama-3-8b shapes.

Each (batch, context) is timed, CUDA-graph replays of back-to-back calls rotating over several
times the L2 (bench/gpu_kernels.py's DecodeCase), as:

  bf16       the production kernel on a bf16 pool (its bytes counted at 2 an element);
             bf16_peel the same with DecodeConfig.peel
  prod       the production kernel on an fp8 pool (DecodeConfig.for_batch)
  prod_peel_asm  the same with DecodeConfig peel and asm_widen: whole tiles in a loop without
             masks, V widened by inline asm instead of a select
  prod_other_v  prod_peel_asm with the other widen_v_first
  prod_r168  prod_peel_asm capped at 168 registers a thread (triton's maxnreg)
  vt_peel    a variant kernel whose V pool is stored transposed in each block, [blocks, kv heads,
             head_dim, block_size]: V reaches the PV dot as K reaches QK^T (cp.async, ldmatrix,
             widened in registers), no transposing copy through shared memory; peeled as prod
  read       the variant kernel with neither dot: K and V read through the block tables and
             xor-folded, the softmax of zero scores: the ceiling of the paged access pattern
  copy       a plain device copy moving the same bytes (half read, half written)

Every fp8 figure counts one byte a K/V element (the issue's target: >= 0.85 of the copy
bandwidth at contexts >= 1k, batch >= 32). `--ncu` instead runs prod and prod_peel_asm a few
times at one shape for Nsight Compute (bench/gpu_fp8_attn.sh); `--knobs` times the production
kernel over peel, V widening, stages and a register cap; `--pairs` times the pool read as
16-bit pairs (DecodeConfig.fp8_pairs, thirteenth session) against the byte-wise read.
(The run of 2026-12-03 had peel and asm_widen on by default: its JSON's `prod` is
prod_peel_asm here, its `prod_old` prod, `bf16` bf16_peel and `bf16_old` bf16.)
Usage: PYTHONPATH=. python3 bench/gpu_fp8_attn.py --out attn.json
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
import triton
import triton.language as tl

from kernels import decode_attention as da
from kernels.decode_attention import DecodeConfig, DecodeWorkspace, default_num_splits

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fp8 import Fp8DecodeCase  # noqa: E402
from gpu_kernels import KVH, D, DecodeCase, H, copy_bandwidth, median_ms  # noqa: E402

CASES = ((32, 1024), (32, 4096), (128, 1024), (128, 4096), (256, 1024), (256, 4096))


@triton.jit
def _e4m3_to_f16(x, pin):
    """e4m3 -> fp16 through cvt.rn.f16x2.e4m3x2, four elements a register. `pin` (int8 of x's
    shape, unused) makes it a two-operand op, which triton does not move past the layout change
    into the dot's operand: V stays widened before shared memory without a select."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
        "cvt.rn.f16x2.e4m3x2 $1, hi; }", "=r,=r,r,r", [x, pin], dtype=tl.float16, is_pure=True,
        pack=4)


@triton.jit
def _tile(q, m_i, l_i, acc, kx, vx, tile, end, k_ptr, v_ptr, table, kvh, qk_scale,
          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
          KD: tl.constexpr, VD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
          V_T: tl.constexpr, V_FIRST: tl.constexpr, DO_QK: tl.constexpr, DO_PV: tl.constexpr,
          MASKED: tl.constexpr, ASM_V: tl.constexpr, SAME_OFFS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_kd = tl.arange(0, KD)
    offs_vd = tl.arange(0, VD)
    pos = tile + offs_n
    n_mask = pos < end
    if MASKED:
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        block = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
    row = (pos % BLOCK_SIZE).to(tl.int64)
    koff = (block * stride_kb + row * stride_kt + kvh * stride_kh)[:, None] + offs_kd[None, :]
    k = tl.load(k_ptr + koff, mask=n_mask[:, None], other=0.0) if MASKED else tl.load(k_ptr + koff)
    if DO_QK:
        s = tl.dot(q, tl.trans(k.to(tl.float16))) * qk_scale
    else:
        kx = kx ^ tl.xor_sum(k, 0)
        s = tl.zeros([q.shape[0], BLOCK_N], tl.float32)
    if MASKED:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if SAME_OFFS:  # V's strides are K's: one address computation for both
        vrow = block * stride_kb + row * stride_kt + kvh * stride_kh
    else:
        vrow = block * stride_vb + row * stride_vt + kvh * stride_vh
    if V_T:  # [VD, BLOCK_N]: 16 tokens of a block are contiguous (the hints say so)
        voff = vrow[None, :] + offs_vd[:, None] * stride_vd
        voff = tl.max_contiguous(tl.multiple_of(voff, [16, 16]), [1, 16])
    else:  # [BLOCK_N, VD]
        voff = vrow[:, None] + offs_vd[None, :] * stride_vd
    if MASKED:
        vm = n_mask[None, :] if V_T else n_mask[:, None]
        v = tl.load(v_ptr + voff, mask=vm, other=0.0)
    else:
        v = tl.load(v_ptr + voff)
    if DO_PV:
        if V_T:
            pv = tl.dot(p.to(tl.float16), tl.trans(v.to(tl.float16)))
        else:
            if V_FIRST:
                if ASM_V:
                    v = _e4m3_to_f16(v, tl.full(v.shape, end, tl.int32).to(tl.int8))
                    if MASKED:
                        v = tl.where(n_mask[:, None], v, 0.0)
                else:
                    v = tl.where(n_mask[:, None], v.to(tl.float16), 0.0)
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
        acc = acc * alpha[:, None] + pv
    else:
        vx = vx ^ tl.xor_sum(v, 0)  # V_T comes with DO_PV
        acc = acc * alpha[:, None]
    return m_new, l_i, acc, kx, vx


@triton.jit
def _variant_kernel(
    q_ptr,                 # [B, H, D]
    k_ptr,                 # [blocks, BS, KVH, KD] (fp8, or int32 words when not DO_QK)
    v_ptr,                 # as k_ptr, or [blocks, KVH, D, BS] when V_T
    tables_ptr, seq_lens_ptr, out_ptr, acc_ptr, max_ptr, sum_ptr,
    qk_scale, num_splits, ws_splits,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_tb, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    V_T: tl.constexpr, V_FIRST: tl.constexpr, DO_QK: tl.constexpr, DO_PV: tl.constexpr,
    PEEL: tl.constexpr = False, ASM_V: tl.constexpr = False, SAME_OFFS: tl.constexpr = False,
):
    kvh = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0).to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    kx = tl.zeros([KD], tl.int32)
    vx = tl.zeros([VD], tl.int32)
    table = tables_ptr + b * stride_tb
    if PEEL:  # the full tiles without masks, then the last, partial one
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for tile in range(start, full_end, BLOCK_N):
            m_i, l_i, acc, kx, vx = _tile(
                q, m_i, l_i, acc, kx, vx, tile, end, k_ptr, v_ptr, table, kvh, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                KD, VD, BLOCK_SIZE, BLOCK_N, V_T, V_FIRST, DO_QK, DO_PV, False, ASM_V, SAME_OFFS)
        if full_end < end:
            m_i, l_i, acc, kx, vx = _tile(
                q, m_i, l_i, acc, kx, vx, full_end, end, k_ptr, v_ptr, table, kvh, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                KD, VD, BLOCK_SIZE, BLOCK_N, V_T, V_FIRST, DO_QK, DO_PV, True, ASM_V, SAME_OFFS)
    else:
        for tile in range(start, end, BLOCK_N):
            m_i, l_i, acc, kx, vx = _tile(
                q, m_i, l_i, acc, kx, vx, tile, end, k_ptr, v_ptr, table, kvh, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                KD, VD, BLOCK_SIZE, BLOCK_N, V_T, V_FIRST, DO_QK, DO_PV, True, ASM_V, SAME_OFFS)
    acc += (tl.xor_sum(kx, 0) ^ tl.xor_sum(vx, 0)).to(tl.float32) * 1e-30
    if SINGLE_SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        part = (b * NUM_HEADS + heads) * ws_splits + split
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(max_ptr + part, m_i, mask=g_mask)
        tl.store(sum_ptr + part, l_i, mask=g_mask)


REGS: dict[str, tuple[int, int]] = {}


def variant(case: Fp8DecodeCase, r: int, splits: int, ws: DecodeWorkspace | None, name: str,
            v_t: bool = False, do_qk: bool = True, do_pv: bool = True, block_n: int = 128,
            warps: int = 4, stages: int = 3, v_first: bool = True, peel: bool = False,
            asm_v: bool = False, same: bool = False, **opts) -> None:
    k = case.k if do_qk else case.k.view(torch.int32)
    v = case.vt if v_t else (case.v if do_pv else case.v.view(torch.int32))
    if v_t:
        sv = (v.stride(0), v.stride(3), v.stride(1), v.stride(2))
    else:
        sv = (v.stride(0), v.stride(1), v.stride(2), 1)
    out, tables = case.out, case.tables[r]
    wsa = (ws.acc, ws.max, ws.sum) if ws is not None else (out,) * 3
    kern = _variant_kernel[(KVH, case.batch, splits)](
        case.q, k, v, tables, case.seq_lens, out, *wsa, D ** -0.5 * da.LOG2E, splits,
        ws.num_splits if ws is not None else 1, case.q.stride(0), case.q.stride(1),
        k.stride(0), k.stride(1), k.stride(2), *sv, tables.stride(0), out.stride(0),
        out.stride(1), NUM_HEADS=H, GROUP=H // KVH, BLOCK_G=16, HEAD_DIM=D,
        KD=D if do_qk else D // 4, VD=D if (do_pv or v_t) else D // 4, BLOCK_SIZE=16,
        BLOCK_N=block_n, SINGLE_SPLIT=splits == 1, V_T=v_t, V_FIRST=v_first, DO_QK=do_qk,
        DO_PV=do_pv, PEEL=peel, ASM_V=asm_v, SAME_OFFS=same, num_warps=warps, num_stages=stages, **opts)
    REGS.setdefault(name, (kern.n_regs, kern.n_spills))
    if ws is not None:
        da._decode_merge_kernel[(case.batch, H)](
            ws.acc, ws.max, ws.sum, out, splits, ws.num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=H, HEAD_DIM=D, BLOCK_D=D, CHUNK_S=max(2, triton.next_power_of_2(splits)),
            num_warps=4)


class _Capped:
    """decode_attention's stage-1 kernel launched with extra compile options (maxnreg); the
    registers and spills of its first launch go to REGS[name]."""

    def __init__(self, fn, name: str, **opts) -> None:
        self.fn, self.name, self.opts = fn, name, opts

    def __getitem__(self, grid):
        def launch(*a, **k):
            kern = self.fn[grid](*a, **k, **self.opts)
            REGS.setdefault(self.name, (kern.n_regs, kern.n_spills))
            return kern
        return launch


def prod(case: DecodeCase, r: int, splits: int, ws: DecodeWorkspace | None,
         cfg: DecodeConfig, name: str = "prod", **opts) -> None:
    orig = da._decode_split_kernel
    da._decode_split_kernel = _Capped(orig, name, **opts)
    try:
        case.call(r, splits, ws, cfg)
    finally:
        da._decode_split_kernel = orig


def graphed_us(case: DecodeCase, fn) -> tuple[float, float]:
    for r in range(case.rot):
        fn(r)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(case.rot):
            fn(r)
    ms, spread = median_ms(graph.replay, 3)
    return ms * 1e3 / case.rot, spread * 1e3 / case.rot


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def run_case(batch: int, ctx: int, copy_tb_s: float) -> dict:
    dev = torch.device("cuda")
    row: dict = {"batch": batch, "ctx": ctx}
    base = DecodeCase(batch, ctx)
    cfg16 = DecodeConfig.for_batch(batch, KVH, dev)
    s16 = default_num_splits(batch, KVH, ctx, dev, cfg16)
    ws = DecodeWorkspace.allocate(batch, H, D, s16, dev) if s16 > 1 else None
    us, _ = graphed_us(base, lambda r: prod(base, r, s16, ws, cfg16, "bf16"))
    row["bf16"] = {"us": us, "frac": base.bytes / us / 1e6 / copy_tb_s}
    peel16 = dataclasses.replace(cfg16, peel=True)
    us, _ = graphed_us(base, lambda r: prod(base, r, s16, ws, peel16, "bf16_peel"))
    row["bf16_peel"] = {"us": us, "frac": base.bytes / us / 1e6 / copy_tb_s}
    base = ws = None
    torch.cuda.empty_cache()

    case = Fp8DecodeCase(batch, ctx)
    case.vt = case.v.permute(0, 2, 3, 1).contiguous()
    cfg = DecodeConfig.for_batch(batch, KVH, dev, fp8=True)
    splits = default_num_splits(batch, KVH, ctx, dev, cfg)
    row["splits"], row["config"] = splits, [cfg.block_n, cfg.widen_v_first]
    ws = DecodeWorkspace.allocate(batch, H, D, splits, dev) if splits > 1 else None
    new = dataclasses.replace(cfg, peel=True, asm_widen=True)
    late = dataclasses.replace(new, widen_v_first=not cfg.widen_v_first)
    runs = {
        "prod": lambda r: prod(case, r, splits, ws, cfg),
        "prod_peel_asm": lambda r: prod(case, r, splits, ws, new, "prod_peel_asm"),
        "prod_other_v": lambda r: prod(case, r, splits, ws, late, "prod_other_v"),
        "prod_r168": lambda r: prod(case, r, splits, ws, new, "prod_r168", maxnreg=168),
        "vt_peel": lambda r: variant(case, r, splits, ws, "vt_peel", v_t=True, peel=True),
        "read": lambda r: variant(case, r, splits, ws, "read", do_qk=False, do_pv=False,
                                  peel=True),
    }
    prod(case, 0, splits, None, cfg)
    want = case.out.clone()
    for name, fn in runs.items():
        try:
            case.out.fill_(float("nan"))
            fn(0)
            err = rel_err(case.out, want) if name not in ("qk_only", "pv_only", "read") else None
            us, spread = graphed_us(case, fn)
        except Exception as e:  # a variant the compiler refuses: the others still count
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        row[name] = {"us": us, "spread": spread, "frac": case.bytes / us / 1e6 / copy_tb_s,
                     "rel_err_vs_prod": err}
    cu = case.copy_us()
    row["copy"] = {"us": cu, "frac": case.bytes / cu / 1e6 / copy_tb_s}
    case = ws = None
    torch.cuda.empty_cache()
    return row


def ncu_mode() -> None:
    """prod twice, then prod_peel_asm twice, eager, at batch 128, context 4096: Nsight Compute
    profiles launches 2-4 (`-s 1 -c 3`)."""
    dev = torch.device("cuda")
    case = Fp8DecodeCase(128, 4096)
    case.vt = case.v.permute(0, 2, 3, 1).contiguous()
    cfg = DecodeConfig.for_batch(128, KVH, dev, fp8=True)
    splits = default_num_splits(128, KVH, 4096, dev, cfg)
    ws = DecodeWorkspace.allocate(128, H, D, splits, dev) if splits > 1 else None
    for c in (cfg,) * 2 + (dataclasses.replace(cfg, peel=True, asm_widen=True),) * 2:
        prod(case, 0, splits, ws, c)
    torch.cuda.synchronize()
    print("ncu mode done (profile launches 2-4: prod, prod_peel_asm x 2)", REGS)


def knobs(copy_tb_s: float) -> list[dict]:
    """The production kernel on an fp8 pool over register caps (maxnreg), stages and where V
    is widened, with and without this session's peeled loop (peel, asm_widen)."""
    dev = torch.device("cuda")
    rows = []
    for batch, ctx in ((128, 4096), (256, 1024), (256, 4096)):
        case = Fp8DecodeCase(batch, ctx)
        base = DecodeConfig.for_batch(batch, KVH, dev, fp8=True)
        splits = default_num_splits(batch, KVH, ctx, dev, base)
        ws = DecodeWorkspace.allocate(batch, H, D, splits, dev) if splits > 1 else None
        for peel, first, stages, cap in itertools.product(
                (False, True), (True, False), (2, 3), (None, 168)):
            cfg = dataclasses.replace(base, peel=peel, asm_widen=peel, widen_v_first=first,
                                      num_stages=stages)
            name = f"peel{int(peel)}_vfirst{int(first)}_st{stages}_r{cap}"
            opts = {"maxnreg": cap} if cap else {}
            try:
                us, _ = graphed_us(case, lambda r, c=case, n=splits, w=ws, cfg=cfg, name=name,
                                   opts=opts: prod(c, r, n, w, cfg, name, **opts))
            except Exception as e:
                print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            rows.append({"batch": batch, "ctx": ctx, "name": name, "us": us,
                         "frac": case.bytes / us / 1e6 / copy_tb_s,
                         "regs_spills": REGS.get(name)})
            REGS.pop(name, None)
            print(f"B={batch} ctx={ctx} {name:<28} {us:8.1f} us {rows[-1]['frac']:.3f} "
                  f"regs/spills {rows[-1]['regs_spills']}", flush=True)
        case = ws = None
        torch.cuda.empty_cache()
    return rows


# (batch, context): None is T4's shape, contexts 512..768 drawn at random
PAIRS_CASES = ((256, None), (32, 1024), (32, 4096), (128, 1024), (128, 4096), (256, 1024),
               (256, 4096))


def pairs_variants(base: DecodeConfig) -> dict[str, DecodeConfig]:
    """The fp8 pool read byte-wise (the kernel before fp8_pairs), DecodeConfig.for_batch's
    choice (`default`: pairs, with the table a tile ahead at one split, else 128 registers),
    then pairs with other launch shapes, by registers and shared memory (sm_90, triton 3.6,
    offline; programs a multiprocessor): plain 162, 41 KB (3); capped at 128 (4); the table a
    tile ahead (prefetch_table: K/V two buffers deep) 168, 74 KB (3); the same with 8 warps 80,
    74 KB (3 of 8 warps); the same on 64-token tiles, 4 stages (K/V three deep) 96, 55 KB (4:
    T4's 2048 programs in 3.9 waves where 3 a multiprocessor take 5.2); plain with 8 warps
    capped at 80 (12 spills; 3 of 8 warps)."""
    rep = dataclasses.replace
    plain = rep(base, prefetch_table=False, max_registers=None)
    return {"bytes": rep(plain, fp8_pairs=False), "default": base, "pairs": plain,
            "pairs_r128": rep(plain, max_registers=128),
            "pf": rep(plain, prefetch_table=True),
            "pf_w8": rep(plain, prefetch_table=True, num_warps=8),
            "pf_bn64_st4": rep(plain, prefetch_table=True, block_n=64, num_stages=4),
            "pairs_w8_r80": rep(plain, num_warps=8, max_registers=80)}


# pairs_variants' names -> gpu_perf.py --decode-config over for_batch's choice at T4's batch
T4_OVERRIDES = {"default": "", "pf": "", "pf_w8": "num_warps=8",
                "pf_bn64_st4": "block_n=64,num_stages=4",
                "pairs_r128": "prefetch_table=0,max_registers=128",
                "pairs_w8_r80": "prefetch_table=0,num_warps=8,max_registers=80"}


def batch1_rows(copy_tb_s: float) -> list[dict]:
    """T3's attention (batch 1, context 576): for_batch's choice with its split count and
    fewer, both merges, against the byte-wise read."""
    from gpu_fp8_step import _attn_case
    dev = torch.device("cuda")
    case = _attn_case(1, 576, True)
    base = DecodeConfig.for_batch(1, KVH, dev, fp8=True)
    n0 = default_num_splits(1, KVH, 4096, dev, base)  # the engine's table holds >= 4k tokens
    rows = []
    for name, cfg, splits in [("bytes", dataclasses.replace(base, fp8_pairs=False), n0)] + [
            (f"pairs_s{n}{'_fused' if fused else ''}", dataclasses.replace(base, fused_merge=fused),
             n) for n in sorted({n0, 32, 16, 8}, reverse=True) for fused in (False, True)]:
        t = case.time(splits, cfg, eager=False)
        rows.append({"name": name, "splits": splits, "us": t["us"], "frac": t["tb_s"] / copy_tb_s})
        print(f"batch 1 ctx 576 {name:<18} {splits:>3} splits {t['us']:6.2f} us", flush=True)
    return rows


def pairs_table(copy_tb_s: float, save=lambda rows: None) -> list[dict]:
    """Decode attention on an fp8 pool read byte-wise and as 16-bit pairs (with launch shape
    variants), the bf16 pool and a copy of the same bytes, at T4's shape and batch 32-256 x
    context 1k-4k; CUDA-graph replays rotating over > L2; errors against the byte-wise read."""
    from gpu_fp8_step import _attn_case
    dev = torch.device("cuda")
    rows = []
    for batch, ctx in PAIRS_CASES:
        row: dict = {"batch": batch, "ctx": ctx or "512..768"}
        case16 = _attn_case(batch, ctx, False)
        cfg16 = DecodeConfig.for_batch(batch, KVH, dev)
        t = case16.time(default_num_splits(batch, KVH, ctx or 768, dev, cfg16), cfg16,
                        eager=False)
        row["bf16"] = {"us": t["us"], "frac": t["tb_s"] / copy_tb_s}
        case16 = None
        torch.cuda.empty_cache()
        case = _attn_case(batch, ctx, True)
        want = None
        for name, cfg in pairs_variants(DecodeConfig.for_batch(batch, KVH, dev, fp8=True)).items():
            splits = default_num_splits(batch, KVH, ctx or 768, dev, cfg)
            try:
                case.out.fill_(float("nan"))
                case.call(0, splits, None, cfg)
                got = case.out.float()
                want = got.clone() if want is None else want
                t = case.time(splits, cfg, eager=False)
            except Exception as e:  # a launch the compiler refuses: the others still count
                print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            row[name] = {"us": t["us"], "spread": t["spread_us"], "splits": splits,
                         "frac": t["tb_s"] / copy_tb_s, "rel_err_vs_bytes": rel_err(got, want),
                         "nan": bool(got.isnan().any())}
        cu = case.copy_us()
        row["copy"] = {"us": cu, "frac": case.bytes / cu / 1e6 / copy_tb_s}
        case = None
        torch.cuda.empty_cache()
        rows.append(row)
        save(rows)
        print(f"B={batch} ctx={row['ctx']}: " + "  ".join(
            f"{k} {v['us']:.1f}/{v['frac']:.2f}" for k, v in row.items() if isinstance(v, dict)),
            flush=True)
    names = [k for k, v in rows[0].items() if isinstance(v, dict)]
    print("fraction of copy (fp8 bytes; bf16 its own), us:")
    print("B/ctx        " + " ".join(f"{n:>15}" for n in names))
    for row in rows:
        print(f"{row['batch']:>3}/{row['ctx']!s:<8} " + " ".join(
            f"{row[n]['frac']:>6.3f} {row[n]['us']:>7.1f}" if n in row else f"{'-':>15}"
            for n in names))
    errs = {n: max(r[n]["rel_err_vs_bytes"] for r in rows if n in r)
            for n in names if n not in ("bf16", "copy")}
    print("max rel err vs bytes:", {k: f"{v:.1e}" for k, v in errs.items()},
          "NaN:", [n for n in names for r in rows if r.get(n, {}).get("nan")])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--knobs", action="store_true", help="time knobs() instead")
    ap.add_argument("--pairs", action="store_true", help="time pairs_table() instead")
    args = ap.parse_args()
    if args.ncu:
        ncu_mode()
        return
    if args.pairs:
        t0 = time.monotonic()
        cp = copy_bandwidth()
        print(f"copy {cp['tb_s']:.2f} TB/s", flush=True)
        result = {"gpu": torch.cuda.get_device_name(), "copy": cp}

        def save(rows: list[dict], key: str = "rows") -> None:
            result[key] = rows
            args.out.write_text(json.dumps(result, indent=1, default=str))
        pairs_table(cp["tb_s"], save)
        save(batch1_rows(cp["tb_s"]), "batch1")
        print(f"done in {time.monotonic() - t0:.0f} s")
        return
    if args.knobs:
        cp = copy_bandwidth()
        rows = knobs(cp["tb_s"])
        args.out.write_text(json.dumps({"copy": cp, "knobs": rows}, indent=1))
        for b, c in sorted({(r["batch"], r["ctx"]) for r in rows}):
            best = sorted((r for r in rows if (r["batch"], r["ctx"]) == (b, c)),
                          key=lambda r: r["us"])[:4]
            print(f"best B={b} ctx={c}: " + "; ".join(
                f"{r['name']} {r['frac']:.3f} {r['regs_spills']}" for r in best))
        return
    t0 = time.monotonic()
    result: dict = {"gpu": torch.cuda.get_device_name(), "copy": copy_bandwidth(), "rows": []}
    copy_tb_s = result["copy"]["tb_s"]
    print(f"copy {copy_tb_s:.2f} TB/s", flush=True)
    for batch, ctx in CASES:
        row = run_case(batch, ctx, copy_tb_s)
        result["rows"].append(row)
        result["regs"] = REGS
        args.out.write_text(json.dumps(result, indent=1))
        print(f"B={batch} ctx={ctx} splits={row['splits']}: " + "  ".join(
            f"{k} {v['us']:.1f}/{v['frac']:.2f}" for k, v in row.items()
            if isinstance(v, dict)), flush=True)
    print("registers, spills:", REGS)
    names = [k for k, v in result["rows"][0].items() if isinstance(v, dict)]
    print("fraction of copy (fp8 bytes; bf16 its own):")
    print("B/ctx     " + " ".join(f"{n:>11}" for n in names))
    for row in result["rows"]:
        print(f"{row['batch']:>3}/{row['ctx']:<5} " + " ".join(
            f"{row[n]['frac']:>11.3f}" if n in row else f"{'-':>11}" for n in names))
    errs = {n: max((r[n].get("rel_err_vs_prod") or 0) for r in result["rows"] if n in r)
            for n in names if n not in ("bf16", "copy")}
    print("max rel err vs prod:", {k: f"{v:.1e}" for k, v in errs.items()})
    print(f"done in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
