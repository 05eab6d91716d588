"""CPU offline throughput on SmolLM2: splitserve's engine, vLLM's CPU build and HF `generate`,
side by side in one run, on the same token-id workloads.

Workloads (built in, or any file in the peer's format with --workload FILE: {"name": str,
"prompts": [[token ids]], "output_lens": [int]}):
  uniform   64 requests, 128 prompt / 64 output tokens
  sharegpt  64 requests, ShareGPT-like lengths (prompts 16-600, outputs 8-256, fixed seed)
  prefix    64 requests in 8 groups; each group's prompts share a 384-token prefix, then 32
            tokens of their own; 64 output tokens
  long      16 requests, 1536 prompt / 64 output tokens
EOS is ignored everywhere so every request generates exactly its output length; greedy. Each
system's prefix cache is reset before every repetition (each repetition computes every prompt);
the best repetition counts. The systems run one after another, never at once.

--peer vllm runs ../shared/peers/vllm_cpu/run.sh (its own venv, all cores bound, tcmalloc and
Intel OpenMP, vLLM's defaults otherwise) on the same workload files. HF `generate` runs in static
padded batches of --hf-batch. Each system's settings and the box's load average go in the JSON,
with resident memory: splitserve's process after its runs (the engine runs in it), beside its
weights + KV pool bytes; vLLM's peak over its process tree (sampled every 0.2 s).

    .venv/bin/python bench/cpu_throughput.py --dtypes float32,bfloat16 --peer vllm \\
        --json bench/results/cpu_throughput.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import tempfile
import time
from datetime import date
from pathlib import Path

import psutil
import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.engine.omp_env import VARIABLE, restart_with_spin_count, wanted_env
from common.flags import build, leaf
from common.models.loader import resolve_model
from common.models.ops_onednn import resolve_cpu_linear

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT.parent / "shared" / "peers" / "vllm_cpu" / "run.sh"
BUILT_IN = ("uniform", "sharegpt", "prefix", "long")


def make_workload(kind: str, n: int, vocab: int, seed: int = 0) -> dict:
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(k)]
    if kind == "uniform":
        prompts, olens = [tokens(128) for _ in range(n)], [64] * n
    elif kind == "sharegpt":  # long-tailed prompts and outputs, synthesised locally
        plens = [min(600, max(16, int(rng.lognormvariate(4.8, 0.8)))) for _ in range(n)]
        olens = [min(256, max(8, int(rng.lognormvariate(4.2, 0.9)))) for _ in range(n)]
        prompts = [tokens(p) for p in plens]
    elif kind == "prefix":
        groups = [tokens(384) for _ in range(8)]
        prompts, olens = [groups[i % 8] + tokens(32) for i in range(n)], [64] * n
    elif kind == "long":
        n = max(1, n // 4)
        prompts, olens = [tokens(1536) for _ in range(n)], [64] * n
    else:
        raise ValueError(f"unknown workload {kind!r} (built in: {', '.join(BUILT_IN)})")
    return {"name": kind, "prompts": prompts, "output_lens": olens}


def run_ours(engine: LLMEngine, w: dict, reps: int) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
              for o in w["output_lens"]]
    best, first8 = float("inf"), []
    for _ in range(reps):
        engine.block_manager.reset_prefix_cache()
        t = time.perf_counter()
        outs = engine.generate(w["prompts"], params)
        best = min(best, time.perf_counter() - t)
        assert [len(o.output_token_ids) for o in outs] == w["output_lens"]
        first8 = [o.output_token_ids for o in outs[:8]]
    return best, first8


def run_hf(model, w: dict, batch: int) -> float:
    prompts, olens = w["prompts"], w["output_lens"]
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


def run_vllm(model_dir: str, workload_file: Path, dtype: str, reps: int) -> dict:
    """The peer's JSON (settings, a row per repetition, first 8 outputs), or {"error": ...}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        log = Path(tmp) / "vllm.log"
        with log.open("w") as f:
            env = {k: v for k, v in os.environ.items() if k != VARIABLE}  # vLLM's own settings
            proc = subprocess.Popen(["bash", str(PEER), model_dir, str(workload_file), dtype,
                                     str(out), "--reps", str(reps)], stdout=f, stderr=f, env=env)
            peak = _peak_tree_rss(proc)
        if proc.returncode != 0 or not out.exists():
            return {"error": log.read_text()[-2000:]}
        return {**json.loads(out.read_text()), "peak_rss_mib": peak}


def _peak_tree_rss(proc: subprocess.Popen) -> dict[str, float]:
    """Waits for proc; the peak resident MiB of its whole tree and of its largest process."""
    root, tree, largest = psutil.Process(proc.pid), 0, 0
    while proc.poll() is None:
        rss = []
        with contextlib.suppress(psutil.Error):
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    rss.append(p.memory_info().rss)
        tree, largest = max(tree, sum(rss)), max(largest, max(rss, default=0))
        time.sleep(0.2)
    return {"tree": round(tree / 2**20), "largest_process": round(largest / 2**20)}


def _engine_bytes(engine: LLMEngine) -> dict[str, float]:
    """MiB of splitserve's process now, and of the model's parameters and the KV pool."""
    weights = sum(t.numel() * t.element_size() for t in engine.model.parameters())
    pool = engine.runner.kv_cache
    return {"rss_mib": round(psutil.Process().memory_info().rss / 2**20),
            "weights_mib": round(weights / 2**20),
            "kv_pool_mib": round(pool.numel() * pool.element_size() / 2**20)}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many of the first requests' greedy outputs are equal, and the first differing index
    of each that is not (a measure of numerical drift between two runs)."""
    firsts = []
    for x, y in zip(a, b, strict=False):
        firsts.append(next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                           None if len(x) == len(y) else min(len(x), len(y))))
    return {"equal": sum(f is None for f in firsts), "of": len(firsts), "first_diff": firsts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="uniform,sharegpt",
                    help=f"built-in workloads, comma-separated ({', '.join(BUILT_IN)})")
    ap.add_argument("--workload", type=Path, action="append", default=[],
                    help="a workload file in the peer's format (repeatable)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--reps", type=int, default=2, help="repetitions per system; best counts")
    ap.add_argument("--peer", choices=("none", "vllm"), default="none",
                    help="also run vLLM's CPU build on the same workloads")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                    help="also run HF transformers' generate")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    cpu_linear = leaf(EngineConfig, "cpu_linear")
    ap.add_argument("--cpu-linear", default=cpu_linear.default, help=cpu_linear.help)
    spin = leaf(EngineConfig, "cpu_omp_spin_count")
    ap.add_argument("--cpu-omp-spin-count", type=int, default=spin.default, help=spin.help)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    restart_with_spin_count(args.cpu_omp_spin_count)  # torch is loaded: the variable needs a start

    load_before = os.getloadavg()
    results: list[dict] = []
    ours_first8: dict[tuple[str, str], list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            engine = LLMEngine(build(EngineConfig, num_kv_blocks=4096, dtype=dtype,
                                     max_num_batched_tokens=args.max_num_batched_tokens,
                                     cpu_linear=args.cpu_linear))
            mc = engine.model_config
            model_dir = str(resolve_model(engine.config.model.name,
                                          engine.config.model.model_cache_dir))
            workloads = [make_workload(k, args.num_requests, mc.vocab_size)
                         for k in args.workloads.split(",") if k]
            workloads += [json.loads(f.read_text()) for f in args.workload]
            settings = {"max_num_batched_tokens": args.max_num_batched_tokens,
                        "max_num_seqs": engine.config.scheduler.max_num_seqs,
                        "block_size": engine.config.cache.block_size,
                        "cpu_linear": resolve_cpu_linear(args.cpu_linear),
                        "omp_env": wanted_env(args.cpu_omp_spin_count),
                        "threads": torch.get_num_threads()}
            for w in workloads:
                ours, first8 = run_ours(engine, w, args.reps)
                ours_first8[(w["name"], dtype)] = first8
                row = {"workload": w["name"], "dtype": dtype, "requests": len(w["prompts"]),
                       "prompt_tokens": sum(map(len, w["prompts"])),
                       "output_tokens": sum(w["output_lens"]), "splitserve_s": round(ours, 2),
                       "splitserve_settings": settings}
                if args.peer == "vllm":
                    path = Path(tmp) / f"{w['name']}.json"
                    path.write_text(json.dumps(w))
                    peer = run_vllm(model_dir, path, dtype, args.reps)
                    row["vllm"] = peer
                    if "rows" in peer:
                        row["vllm_s"] = min(r["wall_s"] for r in peer["rows"])
                        row["vs_vllm"] = round(row["vllm_s"] / ours, 2)
                        row["agreement_with_vllm"] = agreement(first8, peer["first8_token_ids"])
                print(f"  {w['name']} {dtype}: splitserve {ours:.2f} s"
                      + (f", vLLM {row['vllm_s']:.2f} s (peak RSS MiB {peer['peak_rss_mib']})"
                         if "vllm_s" in row else
                         (f", vLLM failed: {row['vllm']['error'][-300:]}" if "vllm" in row
                          else "")), flush=True)
                results.append(row)
            memory = _engine_bytes(engine)
            for row in results:
                if row["dtype"] == dtype:
                    row["splitserve_memory"] = memory
            print(f"  splitserve {dtype} memory (MiB): {memory}", flush=True)
            del engine
            if args.hf:
                from transformers import AutoModelForCausalLM
                hf = AutoModelForCausalLM.from_pretrained(
                    model_dir, dtype=getattr(torch, dtype)).eval()
                for row, w in zip([r for r in results if r["dtype"] == dtype], workloads,
                                  strict=True):
                    theirs = run_hf(hf, w, args.hf_batch)
                    row["hf_s"] = round(theirs, 2)
                    row["vs_hf"] = round(theirs / row["splitserve_s"], 2)
                del hf
    for row in results:  # bf16 against fp32 greedy outputs, for each system run in both
        if row["dtype"] != "float32" and (row["workload"], "float32") in ours_first8:
            row["splitserve_agreement_with_fp32"] = agreement(
                ours_first8[(row["workload"], row["dtype"])],
                ours_first8[(row["workload"], "float32")])
            fp32 = next((r for r in results if r["workload"] == row["workload"]
                         and r["dtype"] == "float32" and "rows" in r.get("vllm", {})), None)
            if fp32 is not None and "rows" in row.get("vllm", {}):
                row["vllm_agreement_with_fp32"] = agreement(
                    row["vllm"]["first8_token_ids"], fp32["vllm"]["first8_token_ids"])
    load = {"before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()]}
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores; load average "
          f"(1, 5, 15 min) before {load['before']}, after {load['after']}")
    print(f"{'workload':<10}{'dtype':<10}{'ours s':>8}{'vLLM s':>8}{'HF s':>8}"
          f"{'ours tok/s':>11}{'x vLLM':>8}{'x HF':>7}")
    for r in results:
        print(f"{r['workload']:<10}{r['dtype']:<10}{r['splitserve_s']:>8}"
              f"{r.get('vllm_s', '-'):>8}{r.get('hf_s', '-'):>8}"
              f"{round(r['output_tokens'] / r['splitserve_s'], 1):>11}"
              f"{r.get('vs_vllm', '-'):>8}{r.get('vs_hf', '-'):>7}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": str(date.today()), "machine": platform.node(),
            "cpu": _cpu_model(), "cores": os.cpu_count(), "load_average": load,
            "torch": torch.__version__, "rows": results}, indent=1))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
