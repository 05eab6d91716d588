"""The per-step cost of tensor parallelism on CPU ranks (gloo): step time at TP 1 and TP N, and
the time rank 0 spends in the collectives (waiting for the slowest rank included) and its share
of the step.

Per model and TP size, one engine (dummy weights of the named shape, float32, prefix caching off):
- decode: 8 sequences of 64-token prompts, then 32 steps in which all 8 decode;
- prefill: a 512-token prompt in one step, 3 times.
Step time is the runner's StepTiming (its launch, which on the CPU runs the forward and the
sampler); collective time is RankGroup's host timing (`timed`). Each rank runs --cpu-threads
torch threads (default 1, so TP 1 and every rank of TP N compute alike; on a box with fewer cores
than ranks they share them).

    .venv/bin/python bench/tp_step.py [--models dummy:smollm2-135m=1,3 dummy:tiny-llama=1,2,4]
                                      [--cpu-threads 1]
                                      [--json bench/results/tp_step_<date>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build

DECODE_BATCH, DECODE_PROMPT, DECODE_STEPS = 8, 64, 32
PREFILL_TOKENS, PREFILL_REPEATS = 512, 3


def _collectives(engine: LLMEngine) -> tuple[dict[str, float], dict[str, int]]:
    if engine.ranks is None:
        return {}, {}
    group = engine.ranks.group
    return dict(group.seconds), dict(group.calls)


def _measure(engine: LLMEngine, steps) -> dict:
    """Runs steps() (which steps the engine) under step timing; per-step averages."""
    sec0, calls0 = _collectives(engine)
    with engine.runner.timed_steps() as timings:
        steps()
    sec1, calls1 = _collectives(engine)
    n = len(timings)
    step_s = sum(t.seconds for t in timings) / n
    coll = {k: (sec1[k] - sec0.get(k, 0.0)) / n for k in sec1}
    calls = {k: (calls1[k] - calls0.get(k, 0)) / n for k in calls1}
    total = sum(coll.values())
    return {"steps": n, "step_ms": 1e3 * step_s,
            "all_reduce_ms": 1e3 * coll.get("all-reduce", 0.0),
            "all_reduces_per_step": calls.get("all-reduce", 0),
            "gather_ms": 1e3 * coll.get("gather", 0.0),
            "collective_ms": 1e3 * total, "collective_share": total / step_s}


def bench(model: str, tp: int, cpu_threads: int, seed: int = 0) -> list[dict]:
    engine = LLMEngine(build(EngineConfig, model=model, tensor_parallel_size=tp,
                             num_kv_blocks=256, max_num_batched_tokens=PREFILL_TOKENS,
                             enable_prefix_caching=False, cpu_threads=cpu_threads))
    try:
        if engine.ranks is not None:
            engine.ranks.group.timed = True
        gen = torch.Generator().manual_seed(seed)
        vocab = engine.model_config.vocab_size

        def prompt(n: int) -> list[int]:
            return torch.randint(3, vocab, (n,), generator=gen).tolist()

        params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0.0, ignore_eos=True)
        for i in range(DECODE_BATCH):
            engine.add_request(f"d{i}", prompt(DECODE_PROMPT), params)
        engine.step()  # the prompts (and the first tokens)
        engine.step()  # warm-up decode

        def decode() -> None:
            for _ in range(DECODE_STEPS):
                engine.step()
        rows = [{"phase": f"decode x{DECODE_BATCH}", **_measure(engine, decode)}]
        while engine.has_unfinished():
            engine.step()
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.generate([prompt(PREFILL_TOKENS)], one)  # warm-up

        def prefill() -> None:
            for _ in range(PREFILL_REPEATS):
                engine.generate([prompt(PREFILL_TOKENS)], one)
        rows.append({"phase": f"prefill {PREFILL_TOKENS}", **_measure(engine, prefill)})
    finally:
        engine.close()
    return [{"model": model, "tp": tp, **r} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+",
                        default=["dummy:smollm2-135m=1,3", "dummy:tiny-llama=1,2,4"],
                        help="MODEL=TP,TP,... (dummy shapes need no checkpoint)")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads per rank (0: the cores shared among the ranks)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    rows = []
    for spec in args.models:
        model, sizes = spec.split("=")
        for tp in map(int, sizes.split(",")):
            rows += bench(model, tp, args.cpu_threads)
    print("| model | TP | phase | step ms | all-reduce ms/step (calls) | gather ms/step | "
          "collectives' share |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tp']} | {r['phase']} | {r['step_ms']:.1f} | "
              f"{r['all_reduce_ms']:.2f} ({r['all_reduces_per_step']:.0f}) | "
              f"{r['gather_ms']:.2f} | {100 * r['collective_share']:.0f}% |")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or
                platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
                "cpu_threads_per_rank": args.cpu_threads, "load_average": os.getloadavg()}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
