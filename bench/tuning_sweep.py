"""The engine's tuning knobs swept on CPU (SmolLM2-135M-Instruct, float32), one table: the figures
behind docs/TUNING.md.

Each sweep holds a workload fixed and varies one knob on a fresh in-process engine (LLMEngine),
greedy with EOS ignored, so each point generates the same number of tokens:

  block_size      --block-size 8/16/32; 16 requests x (128 prompt, 64 output)
  max_num_seqs    --max-num-seqs 8/32/64; 48 requests x (64 prompt, 32 output), all at once
  batched_tokens  --max-num-batched-tokens 256/1024/2048; 16 requests decoding, then one
                  1536-token prompt arrives: its TTFT against the decodes' inter-token gaps
  prefix_cache    --enable-prefix-caching on/off; 16 requests sharing a 384-token system prompt
                  (+ 64 own tokens, 32 output), the prompt cached by one request first
  spec_decode     --speculative-method ngram, k off/4/6; bench/spec_decode.py's input-grounded
                  prompts, 16 at once and 2 one at a time, 96 output tokens
  kv_pool         --num-kv-blocks 48/96/256 (16-token blocks); 16 requests x (128, 64): the
                  batch needs 192 blocks, so the small pools preempt
  cpu             --cpu-threads 1/2, --cpu-linear onednn/torch; the block_size workload
  overlap         --overlap-scheduling off/on; the block_size workload

Throughput is output tokens over the wall time of the whole workload (prefills included); TTFT
runs from add_request to the first token; preemptions are the scheduler's counter.

    .venv/bin/python bench/tuning_sweep.py --out bench/results/tuning_sweep_2026-12-01.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date
from pathlib import Path

import torch
from spec_decode import build_prompts  # bench/ is the script's directory, so on sys.path

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from splitserve.loadgen.datasets import random_lengths, shared_prefix

BASE = dict(num_kv_blocks=1024, cpu_threads=os.cpu_count() or 1)


def engine(**flags) -> LLMEngine:
    return LLMEngine(build(EngineConfig, **(BASE | flags)))


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int,
        late: list[tuple[int, list[int], int]] = ()) -> dict:
    """Run prompts (all at once) to completion; `late` = (after how many first tokens, prompt,
    max_tokens) requests added once that many of the first ones are decoding. Returns output
    tok/s, TTFT p50/p90 (ms), the late requests' TTFT and the others' inter-token gaps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    preempt = eng.scheduler.num_preemptions
    tag = f"r{time.monotonic_ns()}"
    arrival, first, last_tok, gaps, count = {}, {}, {}, [], {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        arrival[f"{tag}-{i}"] = time.perf_counter()
        eng.add_request(f"{tag}-{i}", p, params)
    pending = list(late)
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if not o.new_token_ids:
                continue
            rid = o.request_id
            count[rid] = count.get(rid, 0) + len(o.new_token_ids)
            if rid not in first:
                first[rid] = now
            elif not rid.startswith("late"):
                gaps.append(now - last_tok[rid])
            last_tok[rid] = now
        while pending and sum(not r.startswith("late") for r in first) >= pending[0][0]:
            _, prompt, n = pending.pop(0)
            rid = f"late-{tag}-{len(pending)}"
            arrival[rid] = time.perf_counter()
            eng.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                        ignore_eos=True))
    elapsed = time.perf_counter() - start
    ttft = [(first[r] - arrival[r]) * 1000 for r in arrival if not r.startswith("late")]
    late_ttft = [(first[r] - arrival[r]) * 1000 for r in arrival if r.startswith("late")]
    return {"output_tok_s": round(sum(count.values()) / elapsed, 1), "wall_s": round(elapsed, 2),
            "ttft_p50_ms": round(pct(ttft, 0.5), 1), "ttft_p90_ms": round(pct(ttft, 0.9), 1),
            "late_ttft_ms": round(late_ttft[0], 1) if late_ttft else None,
            "itl_p50_ms": round(pct(gaps, 0.5) * 1000, 1) if gaps else None,
            "itl_max_ms": round(max(gaps) * 1000, 1) if gaps else None,
            "preemptions": eng.scheduler.num_preemptions - preempt}


def warm(eng: LLMEngine, vocab: int) -> None:
    run(eng, [r.prompt_token_ids for r in random_lengths(2, 32, 0.0, 0.0, vocab, 99)], 4)


def prompts_of(n: int, plen: int, vocab: int, seed: int = 0) -> list[list[int]]:
    return [r.prompt_token_ids for r in random_lengths(n, plen, 1, 0.0, vocab, seed)]


def sweep_points(name: str, quick: bool, vocab: int, tokenizer):
    """(label, engine flags, run kwargs) for each point of one sweep."""
    s = 2 if quick else 1  # --quick halves requests and outputs
    base_load = dict(prompts=prompts_of(16 // s, 128, vocab), max_tokens=64 // s)
    if name == "block_size":
        return [(f"block-size {b}", {"block_size": b}, base_load) for b in (8, 16, 32)]
    if name == "max_num_seqs":
        load = dict(prompts=prompts_of(48 // s, 64, vocab), max_tokens=32 // s)
        return [(f"max-num-seqs {m}", {"max_num_seqs": m}, load) for m in (8, 32, 64)]
    if name == "batched_tokens":
        load = dict(prompts=prompts_of(16, 64, vocab), max_tokens=96 // s,
                    late=[(16, prompts_of(1, 1536, vocab, seed=7)[0], 8)])
        return [(f"max-num-batched-tokens {t}", {"max_num_batched_tokens": t}, load)
                for t in (256, 1024, 2048)]
    if name == "prefix_cache":
        reqs = shared_prefix(16 // s + 1, 384, 64, 32, vocab, seed=3)
        load = dict(prompts=[r.prompt_token_ids for r in reqs[1:]], max_tokens=32 // s,
                    prime=reqs[0].prompt_token_ids)
        return [(f"prefix caching {'on' if on else 'off'}", {"enable_prefix_caching": on}, load)
                for on in (True, False)]
    if name == "spec_decode":
        prompts = build_prompts(tokenizer)
        points = []
        for k in (None, 4, 6):
            flags = ({"speculative_method": "ngram", "num_speculative_tokens": k} if k else {})
            label = f"ngram k={k}" if k else "no speculation"
            points.append((f"{label}, batch 16", flags,
                           dict(prompts=prompts[:16 // s], max_tokens=96 // s)))
            points.append((f"{label}, batch 1", flags,
                           dict(prompts=[prompts[0], prompts[8]], max_tokens=96 // s, one=True)))
        return points
    if name == "kv_pool":
        return [(f"num-kv-blocks {n}", {"num_kv_blocks": n}, base_load) for n in (48, 96, 256)]
    if name == "cpu":
        return [(f"cpu-threads {t}, cpu-linear {lin}", {"cpu_threads": t, "cpu_linear": lin},
                 base_load) for t, lin in ((2, "onednn"), (2, "torch"), (1, "onednn"))]
    if name == "overlap":
        return [(f"overlap-scheduling {o}", {"overlap_scheduling": o}, base_load)
                for o in ("off", "on")]
    raise ValueError(f"unknown sweep {name!r}")


SWEEPS = ("block_size", "max_num_seqs", "batched_tokens", "prefix_cache", "spec_decode",
          "kv_pool", "cpu", "overlap")


def measure(flags: dict, load: dict, vocab: int) -> dict:
    eng = engine(**flags)
    warm(eng, vocab)
    load = dict(load)
    if prime := load.pop("prime", None):  # cache the shared prefix first (a no-op when off)
        run(eng, [prime], 1)
    if load.pop("one", False):  # one request at a time; the tok/s over all of them
        parts = [run(eng, [p], load["max_tokens"]) for p in load["prompts"]]
        wall = sum(p["wall_s"] for p in parts)
        out = parts[0] | {"wall_s": round(wall, 2), "output_tok_s": round(
            len(parts) * load["max_tokens"] / wall, 1)}
    else:
        out = run(eng, **load)
    c = eng.spec_counters
    if c.num_draft_tokens:
        out["acceptance"] = round(c.num_accepted_tokens / c.num_draft_tokens, 3)
    if load.get("prompts") and eng.config.cache.enable_prefix_caching:
        out["prefix_hit_rate"] = round(
            eng.block_manager.prefix_hits / max(1, eng.block_manager.prefix_queries), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="half the requests and outputs")
    ap.add_argument("--only", default=",".join(SWEEPS), help=f"comma-separated: {','.join(SWEEPS)}")
    ap.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = ap.parse_args()
    names = args.only.split(",")
    probe = engine(num_kv_blocks=16)
    vocab, tokenizer = probe.model_config.vocab_size, probe.tokenizer
    del probe
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = []
    for name in names:
        for label, flags, load in sweep_points(name, args.quick, vocab, tokenizer):
            t = time.perf_counter()
            r = {"sweep": name, "point": label, "flags": flags,
                 **measure(flags, load, vocab), "point_s": 0.0}
            r["point_s"] = round(time.perf_counter() - t, 1)
            rows.append(r)
            print(f"{name:<15}{label:<36}{r['output_tok_s']:>9}{r['ttft_p50_ms']:>10}"
                  f"{r['ttft_p90_ms']:>10}{r['late_ttft_ms'] or '-':>10}{r['itl_max_ms'] or '-':>9}"
                  f"{r['preemptions']:>6}{r.get('acceptance', '-'):>7}", flush=True)
    total = time.perf_counter() - started
    load = {"before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()]}
    print(f"(columns: output tok/s, TTFT p50 / p90 ms, late long prompt's TTFT ms, decodes' "
          f"longest inter-token gap ms, preemptions, n-gram acceptance)\n{total:.0f} s total; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}; load average before {load['before']}, after {load['after']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": str(date.today()), "machine": platform.node(), "cores": os.cpu_count(),
            "torch": torch.__version__, "quick": args.quick, "total_s": round(total, 1),
            "load_average": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
