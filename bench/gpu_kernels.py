"""GPU kernel benchmark: each figure a fraction of a ceiling measured in the same run.

  copy       device-to-device copy bandwidth (bytes read + written): the memory ceiling
  decode     paged decode attention (T5), llama-3-8b shapes, bf16, block size 16: fewest bytes
             (K/V of every context once, q, out) / time, as a fraction of the copy bandwidth;
             where it splits the context, both ways of merging the splits (fused_merge: in the
             last split's program; else a second launch) are timed side by side
  block_copy scattered KV-block copy between two pools (T7), same fraction
  extend     causal prefill through the extend kernel, TFLOP/s next to torch SDPA (flash)

Decode times are CUDA-graph replays of back-to-back calls whose block tables rotate over a
pool several times the L2, so small cases are not served from cache; `eager` is one Python
launch timed by triton's do_bench. `--sweep` first times launch configurations on a few cases.
Usage: python3 bench/gpu_kernels.py --out kernels.json [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from dataclasses import replace

import torch
import triton
from triton.testing import do_bench

from kernels import torch_ops
from kernels.argmax import argmax_rows
from kernels.block_copy import CopyConfig, copy_blocks
from kernels.decode_attention import (
    DecodeConfig,
    DecodeWorkspace,
    default_num_splits,
    paged_attention_decode,
)
from kernels.extend_attention import ExtendConfig, paged_attention_extend

H, KVH, D, BS = 32, 8, 128, 16  # llama-3-8b attention, block size 16
DT = torch.bfloat16
L2_DEFEAT = 256 << 20           # bytes of distinct K/V touched per graph replay, at least
CONTEXTS, BATCHES = (1024, 4096, 16384), (1, 32, 128)


def median_ms(fn, reps: int = 3) -> tuple[float, float]:
    """(median, spread) over `reps` do_bench medians, in ms."""
    runs = sorted(do_bench(fn, warmup=10, rep=40, return_mode="median") for _ in range(reps))
    return runs[len(runs) // 2], runs[-1] - runs[0]


def graphed_ms(fn, calls: int = 20) -> float:
    """GPU time of one call: `calls` back-to-back calls captured in a CUDA graph, the replay's
    median over do_bench / calls (eager timing of a few-us kernel measures the Python launch)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return do_bench(graph.replay, warmup=5, rep=40, return_mode="median") / calls


def copy_bandwidth() -> dict:
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=DT)
    dst = torch.empty_like(src)
    ms, spread = median_ms(lambda: dst.copy_(src))
    return {"bytes": 4 * n, "ms": ms, "spread_ms": spread, "tb_s": 4 * n / ms / 1e9}


class DecodeCase:
    """Pools, rotating block tables and buffers for one (batch, context)."""

    def __init__(self, batch: int, ctx: int) -> None:
        self.batch, self.ctx = batch, ctx
        self.bytes = 2 * batch * ctx * KVH * D * 2 + 2 * batch * H * D * 2
        per_seq = ctx // BS
        self.rot = max(1, min(64, math.ceil(L2_DEFEAT / self.bytes)))
        nb = self.rot * batch * per_seq
        self.k = torch.randn(nb, BS, KVH, D, device="cuda", dtype=DT)
        self.v = torch.randn(nb, BS, KVH, D, device="cuda", dtype=DT)
        perm = torch.randperm(nb, device="cuda").int()
        self.tables = [perm[r * batch * per_seq:(r + 1) * batch * per_seq].view(batch, per_seq)
                       for r in range(self.rot)]
        self.q = torch.randn(batch, H, D, device="cuda", dtype=DT)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.out = torch.empty_like(self.q)

    def call(self, r: int, splits: int, ws: DecodeWorkspace | None, cfg: DecodeConfig) -> None:
        paged_attention_decode(self.q, self.k, self.v, self.tables[r], self.seq_lens, D ** -0.5,
                               out=self.out, num_splits=splits, workspace=ws, config=cfg)

    def time(self, splits: int, cfg: DecodeConfig, reps: int = 3, eager: bool = True) -> dict:
        ws = DecodeWorkspace.allocate(self.batch, H, D, splits, "cuda") if splits > 1 else None
        for r in range(self.rot):
            self.call(r, splits, ws, cfg)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for r in range(self.rot):
                self.call(r, splits, ws, cfg)
        ms, spread = median_ms(graph.replay, reps)
        us = ms * 1e3 / self.rot
        eager_us = do_bench(lambda: self.call(0, splits, ws, cfg), warmup=10, rep=40,
                            return_mode="median") * 1e3 if eager else None
        return {"us": us, "spread_us": spread * 1e3 / self.rot, "eager_us": eager_us,
                "tb_s": self.bytes / us / 1e6}

    def copy_us(self) -> float:
        """A plain copy moving the same bytes (half read, half written), rotated the same way."""
        n = self.bytes // 4  # bf16 elements read (and written) per call
        src = torch.randn(self.rot, n, device="cuda", dtype=DT)
        dst = torch.empty_like(src)
        graph = torch.cuda.CUDAGraph()
        dst.copy_(src)
        with torch.cuda.graph(graph):
            for r in range(self.rot):
                dst[r].copy_(src[r])
        return median_ms(graph.replay)[0] * 1e3 / self.rot

    def rel_err(self, splits: int, cfg: DecodeConfig) -> float | None:
        if self.batch * self.ctx > 131072:
            return None  # the reference's gathered copy would dwarf the rest
        self.call(0, splits, None, cfg)
        ref = torch_ops.paged_attention_decode(self.q.float(), self.k, self.v, self.tables[0],
                                               self.seq_lens, D ** -0.5)
        return ((self.out.float() - ref).norm() / ref.norm()).item()


def decode_table(given: DecodeConfig | None, copy_tb_s: float) -> list[dict]:
    """One row per case, timed with `given` (None: the launcher's DecodeConfig.for_batch); where
    there are splits, also with the other merge (graph replays only): `us_fused` and
    `us_two_launch` (None with one split: nothing to merge)."""
    rows = []
    for ctx, batch in itertools.product(CONTEXTS, BATCHES):
        case = DecodeCase(batch, ctx)
        cfg = given or DecodeConfig.for_batch(batch, KVH, torch.device("cuda"))
        splits = default_num_splits(batch, KVH, ctx, torch.device("cuda"), cfg)
        row = {"batch": batch, "ctx": ctx, "block_n": cfg.block_n, "splits": splits,
               "mb": case.bytes / 1e6,
               **case.time(splits, cfg), "rel_err": case.rel_err(splits, cfg),
               "us_fused": None, "us_two_launch": None}
        if splits > 1:
            other = replace(cfg, fused_merge=not cfg.fused_merge)
            t = case.time(splits, other, eager=False)
            fused, two = (row, t) if cfg.fused_merge else (t, row)
            row["us_fused"], row["us_two_launch"] = fused["us"], two["us"]
            row["other_merge"] = {"fused_merge": other.fused_merge, **t,
                                  "rel_err": case.rel_err(splits, other)}
        row["frac_copy"] = row["tb_s"] / copy_tb_s
        row["same_copy_us"] = case.copy_us()
        rows.append(row)
        del case
        torch.cuda.empty_cache()
    return rows


SWEEP_CASES = ((1, 16384), (32, 4096), (128, 1024), (128, 16384))
SWEEP_CONFIGS = [DecodeConfig(bn, w, s, waves) for bn, w, s, waves in itertools.product(
    (32, 64, 128), (4, 8), (2, 3), (1, 2, 4))] + [DecodeConfig(64, 2, 3, 2)]
# The decode steps the engine benchmarks run (T3's batch 1, T4's batch 256 and the batches
# between, at their contexts), over tile, warps and stages.
ENGINE_CASES = ((1, 576), (4, 576), (8, 512), (16, 512), (32, 512), (64, 512), (128, 640),
                (256, 640), (256, 768))
ENGINE_CONFIGS = [DecodeConfig(bn, w, s, fused_merge=f) for bn, w, s, f in
                  itertools.product((32, 64), (4, 8), (2, 3, 4), (False, True))]
ENGINE_TABLE_CTX = 2048  # gpu_perf.py and gpu_profile.py build engines with max_model_len 2048


def decode_sweep(copy_tb_s: float, cases=SWEEP_CASES, configs=SWEEP_CONFIGS,
                 table_ctx: int = 0) -> tuple[list[dict], DecodeConfig]:
    """Times every configuration on each (batch, ctx) case; returns the timings and the
    configuration with the best geometric mean of (time / best time of that case). The split
    count comes from the launcher's heuristic for a block table of max(ctx, table_ctx) tokens
    (the engine's tables are max_model_len wide)."""
    results = []
    chosen_rel = []  # per case: the launcher's own choice (DecodeConfig.for_batch) / the best
    for batch, ctx in cases:
        case = DecodeCase(batch, ctx)
        for cfg in configs:
            splits = default_num_splits(batch, KVH, max(ctx, table_ctx), torch.device("cuda"),
                                        cfg)
            try:
                t = case.time(splits, cfg, reps=1, eager=False)
            except triton.runtime.errors.OutOfResources:
                continue
            results.append({"batch": batch, "ctx": ctx, "config": cfg, "splits": splits,
                            "us": t["us"], "frac_copy": t["tb_s"] / copy_tb_s})
        mine = sorted((r for r in results if (r["batch"], r["ctx"]) == (batch, ctx)),
                      key=lambda r: r["us"])
        chosen = DecodeConfig.for_batch(batch, KVH, torch.device("cuda"))
        default = [r for r in mine if r["config"] == chosen]
        for r in mine[:4] + [r for r in default if r not in mine[:4]]:
            print(f"sweep B={batch:<3} ctx={ctx:<5} {r['config']} splits={r['splits']:<3} "
                  f"{r['us']:8.1f} us {100 * r['frac_copy']:5.1f}%"
                  + ("  (default)" if r in default else ""))
        for r in mine:
            r["rel"] = r["us"] / mine[0]["us"]
        chosen_rel += [math.log(r["rel"]) for r in default]
        del case
        torch.cuda.empty_cache()
    score: dict[DecodeConfig, list[float]] = {}
    for r in results:
        score.setdefault(r["config"], []).append(math.log(r["rel"]))
    n = len(cases)
    best = min((c for c in score if len(score[c]) == n), key=lambda c: sum(score[c]))
    print(f"sweep best overall: {best} geomean {math.exp(sum(score[best]) / n):.3f} x the "
          f"per-case best; DecodeConfig.for_batch "
          + (f"{math.exp(sum(chosen_rel) / n):.3f}" if len(chosen_rel) == n else "not swept"))
    for r in results:
        r["config"] = str(r["config"])
    return results, best


def block_copy_bench(copy_tb_s: float) -> list[dict]:
    layers, nb, n = 32, 2048, 1024
    src = torch.randn(layers, 2, nb, BS, KVH, D, device="cuda", dtype=DT)
    dst = torch.empty_like(src)
    src_ids = torch.randperm(nb, device="cuda")[:n]
    dst_ids = torch.randperm(nb, device="cuda")[:n]
    moved = 2 * layers * 2 * n * BS * KVH * D * 2
    rows = []
    for cfg in (CopyConfig(2048, 4), CopyConfig(4096, 4), CopyConfig(8192, 8),
                CopyConfig(16384, 8)):
        ms, spread = median_ms(lambda cfg=cfg: copy_blocks(src, dst, src_ids, dst_ids,
                                                           config=cfg))
        rows.append({"chunk": cfg.chunk, "warps": cfg.num_warps, "blocks": n, "gb": moved / 1e9,
                     "ms": ms, "tb_s": moved / ms / 1e9, "frac_copy": moved / ms / 1e9 /
                     copy_tb_s})
    want = dst.clone()
    torch_ops.copy_blocks(src, want, src_ids, dst_ids)
    assert torch.equal(dst, want), "block copy differs from the reference"
    return rows


def argmax_bench(copy_tb_s: float, vocab: int = 128256) -> list[dict]:
    """kernels.argmax.argmax_rows against torch.argmax over float32 logits rows at the decode
    batch sizes (the sampler's greedy pick when a batch also samples, penalises or asks for
    logprobs; a plain greedy decode batch reads the graph's bf16 rows, half these bytes);
    fraction of the copy bandwidth for the bytes read."""
    rows_out = []
    for rows in (1, 4, 16, 32, 64, 128, 256):
        x = torch.randn(rows, vocab, device="cuda", dtype=torch.float32)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), "argmax_rows differs from torch"
        ours, theirs = (graphed_ms(lambda x=x, f=f: f(x)) for f in
                        (argmax_rows, lambda t: t.argmax(dim=-1)))
        read = x.numel() * 4
        rows_out.append({"rows": rows, "vocab": vocab, "kernel_us": ours * 1e3,
                         "torch_us": theirs * 1e3,
                         "kernel_frac_copy": read / ours / 1e9 / copy_tb_s})
    return rows_out


def extend_case(batch: int, q_len: int, prefix: int, configs: list[ExtendConfig]) -> list[dict]:
    ctx = prefix + q_len
    per_seq = math.ceil(ctx / BS)
    k = torch.randn(batch * per_seq, BS, KVH, D, device="cuda", dtype=DT)
    v = torch.randn_like(k)
    tables = torch.randperm(batch * per_seq, device="cuda").int().view(batch, per_seq)
    q = torch.randn(batch * q_len, H, D, device="cuda", dtype=DT)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    flops = 4 * batch * H * D * (q_len * prefix + q_len * (q_len + 1) / 2)
    case = {"batch": batch, "q_len": q_len, "prefix": prefix}
    rows = []
    for cfg in configs:
        try:
            ms, _ = median_ms(lambda cfg=cfg: paged_attention_extend(
                q, k, v, tables, qsl, lens, D ** -0.5, config=cfg), reps=1)
        except triton.runtime.errors.OutOfResources:
            continue
        rows.append({**case, "config": f"{cfg.block_m}/{cfg.block_n}/{cfg.num_warps}/"
                     f"{cfg.num_stages}", "ms": ms, "tflops": flops / ms / 1e9})
    if prefix == 0:  # peer: torch SDPA (flash) on the same tokens, dense and contiguous
        qd = q.view(batch, q_len, H, D).transpose(1, 2)
        kd = torch.randn(batch, KVH, q_len, D, device="cuda", dtype=DT)
        ms, _ = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            qd, kd, kd, is_causal=True, enable_gqa=True), reps=1)
        rows.append({**case, "config": "torch_sdpa", "ms": ms, "tflops": flops / ms / 1e9})
    return rows


SHORT_EXTEND_CONFIGS = [ExtendConfig(m, n, w, s) for m, n, w, s in (
    (16, 64, 4, 2), (16, 32, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2), (16, 64, 2, 3))]


def extend_bench(sweep: bool) -> list[dict]:
    configs = ([ExtendConfig(m, n, w, 2) for m, n, w in itertools.product(
        (64, 128), (32, 64), (4, 8))] if sweep else [ExtendConfig()])
    # T6's step: 100 new tokens after a 500-token cached prefix; few query tiles, so the tile
    # height decides how many programs share the work.
    return (extend_case(8, 512, 0, configs) + extend_case(8, 512, 2048, configs)
            + extend_case(1, 100, 500, SHORT_EXTEND_CONFIGS)
            + extend_case(4, 32, 1024, SHORT_EXTEND_CONFIGS))


def print_decode_table(title: str, rows: list[dict]) -> None:
    """The main columns are the table's config; `us fused` / `us 2-launch` time both merges
    (graph replays), `rel err` is the worse of the two."""
    print(f"\n{title}")
    print("| batch | ctx | tile | splits | MB | us (graph) | spread | TB/s | % copy | us fused "
          "| us 2-launch | us same-size copy | us eager | rel err |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        errs = [e for e in (r["rel_err"], r.get("other_merge", {}).get("rel_err"))
                if e is not None]
        err = f"{max(errs):.1e}" if errs else "-"
        fused, two = (("-" if us is None else f"{us:.1f}")
                      for us in (r["us_fused"], r["us_two_launch"]))
        print(f"| {r['batch']} | {r['ctx']} | {r['block_n']} | {r['splits']} | {r['mb']:.0f} | "
              f"{r['us']:.1f} | {r['spread_us']:.1f} | {r['tb_s']:.2f} | "
              f"{100 * r['frac_copy']:.1f} | {fused} | {two} | {r['same_copy_us']:.1f} | "
              f"{r['eager_us']:.1f} | {err} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the full results")
    ap.add_argument("--sweep", action="store_true",
                    help="time launch configurations first, then tabulate the best one too")
    ap.add_argument("--sweep-engine", action="store_true",
                    help="only sweep decode configurations at the engine benchmarks' batch "
                         "sizes and contexts, then stop")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "gpu": props.name,
                    "sms": props.multi_processor_count, "torch": torch.__version__,
                    "triton": triton.__version__, "decode_config": str(DecodeConfig()),
                    "extend_config": str(ExtendConfig())}
    copy = copy_bandwidth()
    result["copy"] = copy
    print(f"copy bandwidth: {copy['tb_s']:.2f} TB/s (spread {copy['spread_ms'] * 1e3:.0f} us)")
    result["argmax"] = argmax_bench(copy["tb_s"])
    for r in result["argmax"]:
        print(f"argmax {r['rows']} x {r['vocab']} float32: kernel {r['kernel_us']:.1f} us "
              f"({100 * r['kernel_frac_copy']:.0f}% of copy), torch.argmax {r['torch_us']:.1f} us")
    if args.sweep_engine:
        result["decode_sweep_engine"], best = decode_sweep(copy["tb_s"], ENGINE_CASES,
                                                           ENGINE_CONFIGS, ENGINE_TABLE_CTX)
        result["decode_sweep_engine_best"] = str(best)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    tuned = None
    if args.sweep:
        result["decode_sweep"], tuned = decode_sweep(copy["tb_s"])
    result["block_copy"] = block_copy_bench(copy["tb_s"])
    result["extend"] = extend_bench(args.sweep)
    result["decode"] = decode_table(None, copy["tb_s"])
    if tuned is not None and tuned != DecodeConfig():
        result["decode_tuned"] = {"config": str(tuned),
                                  "rows": decode_table(tuned, copy["tb_s"])}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    default = ExtendConfig()
    shown = f"{default.block_m}/{default.block_n}/{default.num_warps}/{default.num_stages}"
    best = sorted(result["extend"], key=lambda r: -r["tflops"])
    short = [r for r in result["extend"] if r["q_len"] < 512]
    for r in ([r for r in result["extend"] if r["config"] in (shown, "torch_sdpa")
               and r["q_len"] == 512] + best[:4] + short):
        print(f"extend B={r['batch']} q={r['q_len']} prefix={r['prefix']} {r['config']} "
              f"(m/n/warps/stages): {r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s")
    for r in result["block_copy"]:
        print(f"block copy chunk={r['chunk']} warps={r['warps']}: {r['tb_s']:.2f} TB/s "
              f"= {100 * r['frac_copy']:.1f}% of copy")
    head = (f"decode attention, {props.name}, H={H} KVH={KVH} D={D} bf16 block {BS}, "
            f"copy {copy['tb_s']:.2f} TB/s")
    print_decode_table(f"{head}, DecodeConfig.for_batch (default)", result["decode"])
    if "decode_tuned" in result:
        print_decode_table(f"{head}, {tuned} (sweep best)", result["decode_tuned"]["rows"])


if __name__ == "__main__":
    main()
