"""GPU performance, targets T1-T4, T6, T7 of ../shared/BENCHMARKS.md, in one run, side by side.

Random ("dummy") weights of a real shape (llama-3-8b by default), bf16, EOS ignored so every
request generates its full length. Ours is LLMEngine with CudaGraphRunner; the peer is HF
transformers `generate` (eager, bf16, DynamicCache) on the same shape in the same process after
ours is freed. Ceilings are measured first in the same run: device-to-device copy bandwidth
(bytes read + written) and the bf16 matmul rate (8192^3).

  T3, T4  decode step at batch 1 (512-token prompt) and 256 (512 in / 256 out, contexts
          512..768, median ~640): engine step wall time (host work included) and the graph
          replay alone (CUDA events), against (weight bytes + KV bytes read) / copy bandwidth
  T1      offline, N prompts 512 in / 256 out, up to --max-num-seqs decoding at once; output
          tok/s; floor: prefill FLOPs / matmul rate + each decode step at its roofline (the
          slower of weight reads and matmul FLOPs, plus K/V reads); peer HF at batch 64 and 256
          (one batch each)
  T2      offline, N ShareGPT-like requests (prompt 16..1024, output 8..256, lognormal, fixed
          seed); peer HF on the first 64 in one static padded batch (runs to its longest output)
  T6      TTFT of 500 shared + 100 new tokens with the shared prefix cached vs a cold prompt
  T7      export_kv + import_kv of a 512-token prompt's blocks vs that prompt's prefill time

Every section checks the time left (--budget seconds) first and is skipped, saying so, when it
would not fit; JSON goes to --out after each section. `--quantization fp8` and
`--kv-cache-dtype fp8` build the engine with fp8 weights / an fp8 KV pool (the floors count
their bytes: 1 a weight, 1 a K/V element); `--sections T3,T4,T1` runs only those.

    PYTHONPATH=. python3 bench/gpu_perf.py --out perf.json --budget 280
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build

sys.path.insert(0, str(Path(__file__).parent))
from gpu_model_check import build_engine, hf_model  # noqa: E402

BENCH_BW_TBS, BENCH_MM_TFLOPS = 4.27, 801.0  # BENCHMARKS.md, used only off CUDA (smoke runs)


class Run:
    """Results, the time budget and the JSON file, shared by the sections."""

    def __init__(self, out: Path, budget: float):
        self.out, self.budget, self.t0 = out, budget, time.monotonic()
        self.results: dict = {}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def section(self, name: str, need: float, fn, *args) -> object:
        if self.left() < need:
            self.results[name] = {"skipped": f"{self.left():.0f} s left, needs ~{need:.0f} s"}
            print(f"-- {name}: skipped ({self.left():.0f} s left, needs ~{need:.0f})", flush=True)
            self.save()
            return None
        print(f"-- {name} ({self.left():.0f} s left)", flush=True)
        t = time.monotonic()
        try:
            value = fn(*args)
        except Exception as e:  # one broken section must not cost the others their numbers
            traceback.print_exc()
            value = {"error": f"{type(e).__name__}: {e}"}
        if isinstance(value, dict):
            value["seconds"] = round(time.monotonic() - t, 2)
            self.results[name] = value
        self.save()
        return value

    def save(self) -> None:
        self.out.write_text(json.dumps(self.results, indent=1, default=str))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def event_ms(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def ceilings(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"copy_tb_s": BENCH_BW_TBS, "matmul_tflops": BENCH_MM_TFLOPS, "source": "table"}
    from triton.testing import do_bench
    n = 1 << 30
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, warmup=10, rep=50, return_mode="median")
    # FP8 (e4m3) with row-wise scales, as --quantization fp8 runs its projections.
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    sa = torch.ones(8192, 1, device=device)
    sb = torch.ones(1, 8192, device=device)
    mm8_ms = do_bench(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                               out_dtype=torch.bfloat16),
                      warmup=10, rep=50, return_mode="median")
    return {"copy_tb_s": 4 * n / copy_ms / 1e9, "matmul_tflops": 2 * 8192**3 / mm_ms / 1e9,
            "fp8_matmul_tflops": 2 * 8192**3 / mm8_ms / 1e9,
            "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}


# ---- workloads --------------------------------------------------------------------------------
def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo = min(1000, vocab // 2)  # clear of the special tokens at the start of real vocabularies
    return [rng.randrange(lo, vocab - 1) for _ in range(n)]


def uniform(n: int, plen: int, olen: int, vocab: int, seed: int) -> tuple[list, list]:
    rng = random.Random(seed)
    return [random_tokens(rng, plen, vocab) for _ in range(n)], [olen] * n


def sharegpt_like(n: int, vocab: int, seed: int = 1) -> tuple[list, list]:
    rng = random.Random(seed)
    plens = [min(1024, max(16, int(rng.lognormvariate(5.5, 0.8)))) for _ in range(n)]
    olens = [min(256, max(8, int(rng.lognormvariate(4.9, 0.9)))) for _ in range(n)]
    return [random_tokens(rng, p, vocab) for p in plens], olens


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# ---- ours -------------------------------------------------------------------------------------
class Ours:
    def __init__(self, engine: LLMEngine, ceil: dict):
        self.engine, self.ceil = engine, ceil
        self.runner = engine.runner
        self.device = engine.device
        mc = engine.model_config
        # Parameters and the fp8 projections' buffers (qweight, weight_scale); not cos_sin.
        weights = [*engine.model.parameters(),
                   *(b for n, b in engine.model.named_buffers() if not n.endswith("cos_sin"))]
        self.weight_bytes = sum(p.numel() * p.element_size() for p in weights)
        self.kv_bytes_per_token = 2 * mc.num_layers * mc.kv_size * engine.kv_cache.element_size()
        # Matmul FLOPs per token (embedding lookup excluded, lm_head included; scales excluded).
        embed = mc.vocab_size * mc.hidden_size
        self.flops_per_token = 2 * (sum(p.numel() for p in weights if p.dim() == 2)
                                    - (0 if mc.tie_word_embeddings else embed))
        # Of them, those of fp8 weights (run at the fp8 matmul rate).
        self.fp8_flops_per_token = 2 * sum(p.numel() for p in weights
                                           if p.dtype == torch.float8_e4m3fn)
        self.mc = mc

    def matmul_s(self, tokens: int, head_tokens: int) -> float:
        """Seconds of matmul FLOPs for `tokens` through the layers and `head_tokens` through
        lm_head, each dtype's share at its measured rate."""
        lm_head = 2 * self.mc.vocab_size * self.mc.hidden_size
        bf16 = (self.flops_per_token - self.fp8_flops_per_token - lm_head) * tokens \
            + lm_head * head_tokens
        fp8 = self.fp8_flops_per_token * tokens
        rate8 = self.ceil.get("fp8_matmul_tflops", 2 * self.ceil["matmul_tflops"])
        return bf16 / (self.ceil["matmul_tflops"] * 1e12) + fp8 / (rate8 * 1e12)

    def bw(self) -> float:
        return self.ceil["copy_tb_s"] * 1e12

    def decode_floor_ms(self, batch: int, context: float) -> float:
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / self.bw() * 1e3

    def decode_roofline_ms(self, batch: int, context: float) -> float:
        """The matmuls at the slower of weight reads and matmul FLOPs (at batch 256 the 8B
        shape's matmuls are compute-bound), then attention's K/V reads at the bandwidth."""
        matmul_s = max(self.weight_bytes / self.bw(), self.matmul_s(batch, batch))
        return (matmul_s + batch * context * self.kv_bytes_per_token / self.bw()) * 1e3

    def decode_steps(self, batch: int, plen: int, olen: int, probe_at: int) -> dict:
        """Engine step wall times of the decode-only (graph) steps; graph replay alone, timed
        with events, when the contexts are plen + probe_at."""
        prompts, _ = uniform(batch, plen, olen, self.mc.vocab_size, seed=batch)
        e = self.engine
        for i, p in enumerate(prompts):
            e.add_request(f"d{batch}-{i}", p, greedy(olen))
        walls, replay = [], None
        started: set[str] = set()  # requests past their first token: then every step decodes
        while e.has_unfinished():
            decoding = len(started) == batch
            t = time.perf_counter()
            outs = e.step()
            dt = time.perf_counter() - t
            started.update(o.request_id for o in outs)
            if decoding:
                walls.append(dt * 1e3)
                if len(walls) == probe_at and self.runner.graphs:
                    # Replays rewrite the last step's K/V slots with the same values.
                    g = self.runner.graphs[self.runner.bucket_for(batch)].graph
                    replay = event_ms(g.replay, 20)
        ctx = plen + probe_at
        step = statistics.median(walls)
        return {"batch": batch, "context": ctx, "engine_step_ms": step,
                "graph_steps": self.runner.steps["graph"],
                "engine_step_spread_ms": [min(walls), max(walls)],
                "graph_replay_ms": statistics.median(replay) if replay else None,
                "floor_ms": self.decode_floor_ms(batch, ctx),
                "roofline_ms": self.decode_roofline_ms(batch, ctx), "decode_steps": len(walls)}

    def offline(self, prompts: list, olens: list) -> dict:
        """generate() over the prompts; also splits the wall time at the last step that was not
        a decode-graph replay: the prefill phase (prefill chunks, mixed steps) and the decode
        phase after it. Steps are timed at the return of their launch (runner.timed_steps()),
        which overlap scheduling paces by the device one step behind, so the split is within
        one step of the device's (~0.2 s of T1's 8192-token steps)."""
        runner = self.runner
        steps0 = dict(runner.steps)
        with runner.timed_steps() as launches:
            sync(self.device)
            t = time.perf_counter()
            outs = self.engine.generate(prompts, [greedy(o) for o in olens])
            sync(self.device)
            end = time.perf_counter()
        elapsed = end - t
        assert [len(o.output_token_ids) for o in outs] == olens
        steps = {k: v - steps0[k] for k, v in runner.steps.items()}
        last_other = max((i for i, s in enumerate(launches) if s.kind != "graph"), default=-1)
        split = launches[last_other + 1].end if last_other + 1 < len(launches) else end
        return {"requests": len(prompts), "output_tokens": sum(olens),
                "prompt_tokens": sum(map(len, prompts)), "seconds_run": elapsed,
                "tok_s": sum(olens) / elapsed, "runner_steps": steps,
                "prefill_phase_s": split - t, "prefill_phase_steps": last_other + 1,
                "decode_phase_s": end - split,
                "decode_phase_steps": len(launches) - last_other - 1}

    def offline_floor_parts(self, prompts: list, olens: list, batch: int) -> tuple[float, float]:
        """offline_floor_s in its two parts: (prefill, decode) seconds."""
        prefill_s = self.matmul_s(sum(len(p) for p in prompts), len(prompts))
        decode_ms = 0.0
        order = list(range(len(prompts)))
        for w in range(0, len(order), batch):
            wave = order[w:w + batch]
            for s in range(max(olens[i] for i in wave)):
                live = [i for i in wave if olens[i] > s]
                context = sum(len(prompts[i]) + s for i in live) / len(live)
                decode_ms += self.decode_roofline_ms(len(live), context)
        return prefill_s, decode_ms / 1e3

    def offline_floor_s(self, prompts: list, olens: list, batch: int) -> float:
        """Prefill matmuls at the measured rate (lm_head on each prompt's last token only),
        then requests decoding in waves of `batch`, each step at its roofline
        (decode_roofline_ms: the matmuls at the slower of one weight read and the live rows'
        FLOPs, plus the live contexts' K/V at the bandwidth)."""
        return sum(self.offline_floor_parts(prompts, olens, batch))

    def ttft(self, prompt: list[int], rid: str) -> float:
        e = self.engine
        sync(self.device)
        t = time.perf_counter()
        e.add_request(rid, prompt, greedy(1))
        while e.has_unfinished():
            e.step()
        return (time.perf_counter() - t) * 1e3

    def prefix_ttft(self, reps: int = 5) -> dict:
        rng = random.Random(6)
        vocab = self.mc.vocab_size

        def toks(n: int) -> list[int]:
            return random_tokens(rng, n, vocab)

        shared = toks(500)
        self.ttft(shared + toks(100), "warm-shared")  # puts the shared prefix in the cache
        cold = [self.ttft(toks(600), f"cold{i}") for i in range(reps)]
        hot = [self.ttft(shared + toks(100), f"hot{i}") for i in range(reps)]
        return {"uncached_ms": statistics.median(cold), "cached_ms": statistics.median(hot),
                "ratio": statistics.median(hot) / statistics.median(cold),
                "cached_tokens": (500 // self.engine.config.cache.block_size)
                * self.engine.config.cache.block_size}

    def handoff(self, plen: int = 512, reps: int = 20) -> dict:
        e = self.engine
        prompt, _ = uniform(1, plen, 1, self.mc.vocab_size, seed=7)
        prefill = [self.ttft(uniform(1, plen, 1, self.mc.vocab_size, seed=8 + i)[0][0],
                             f"pf{i}") for i in range(3)]
        e.add_request("held", prompt[0], SamplingParams(max_tokens=1, temperature=0.0,
                                                         ignore_eos=True), hold_kv=True)
        held = None
        while e.has_unfinished():
            for o in e.step():
                held = o.held_block_ids or held
        dst = e.kv.reserve(len(held))
        nbytes = len(held) * self.runner.bytes_per_block

        def move() -> None:
            e.kv.import_(dst, e.kv.export(held))

        move()
        if self.device.type == "cuda":
            ms = statistics.median(event_ms(move, reps))
        else:
            t = time.perf_counter()
            move()
            ms = (time.perf_counter() - t) * 1e3
        same = bool(torch.equal(e.kv.export(held), e.kv.export(dst)))
        e.kv.free(dst)
        e.kv.release("held")
        return {"blocks": len(held), "bytes": nbytes, "export_import_ms": ms,
                "prefill_ms": statistics.median(prefill),
                "fraction_of_prefill": ms / statistics.median(prefill),
                # export reads + writes, import reads + writes: 4x the blocks' bytes
                "copy_tb_s": 4 * nbytes / ms / 1e9, "copied_exactly": same}


# ---- HF ---------------------------------------------------------------------------------------
@torch.inference_mode()
def hf_generate(model, prompts: list, olens: list, device: torch.device) -> dict:
    """One static batch, left-padded; runs to the longest output (EOS is off in the config)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    steps = max(olens)
    sync(device)
    t = time.perf_counter()
    out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=steps,
                         do_sample=False)
    sync(device)
    elapsed = time.perf_counter() - t
    assert out.shape[1] == width + steps
    return {"batch": len(prompts), "useful_output_tokens": sum(olens), "steps": steps,
            "seconds_run": elapsed, "tok_s": sum(olens) / elapsed}


def decode_overrides(spec: str) -> dict:
    """"fp8_pairs=0,block_n=64" -> {"fp8_pairs": False, "block_n": 64}, typed by the field's
    default."""
    from kernels.decode_attention import DecodeConfig
    defaults = DecodeConfig()
    out = {}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        kind = type(getattr(defaults, key))
        out[key] = bool(int(value)) if kind is bool else (
            None if value == "None" else int(value))
    return out


@contextlib.contextmanager
def decode_config(overrides: dict):
    """The engine built inside launches decode attention with `overrides` over
    DecodeConfig.for_batch's choice (its CUDA graphs capture them)."""
    from kernels.decode_attention import DecodeConfig
    if not overrides:
        yield
        return
    orig = DecodeConfig.__dict__["for_batch"]
    DecodeConfig.for_batch = classmethod(
        lambda cls, *a, **k: dataclasses.replace(orig.__func__(cls, *a, **k), **overrides))
    try:
        yield
    finally:
        DecodeConfig.for_batch = orig


# ---- the run ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=280.0, help="seconds for the whole run")
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--prompts", type=int, default=1000, help="T1 and T2 request counts")
    ap.add_argument("--batch", type=int, default=256, help="T4's batch")
    ap.add_argument("--max-num-seqs", type=int, default=1024,
                    help="the engine's max_num_seqs: how many of T1's and T2's requests decode "
                         "at once (at least --batch)")
    ap.add_argument("--num-kv-blocks", type=int, default=50000,
                    help="KV pool in blocks of 16 tokens (50000: T1's 1000 x 768 tokens fit "
                         "at once)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quantization", default=None, help="fp8: the engine's --quantization")
    ap.add_argument("--kv-cache-dtype", default="auto", help="fp8: the engine's KV pool")
    ap.add_argument("--sections", default="T3,T4,T1,T2,T6,T7",
                    help="our sections to run, comma-separated")
    ap.add_argument("--gemv-configs", type=Path, default=None,
                    help="a `bench/gpu_fp8.py --sweep gemv --engine` JSON: the batch-1 fp8 "
                         "GEMVs launch with the configs it chose")
    ap.add_argument("--decode-config", default="",
                    help="KEY=VALUE,...: DecodeConfig fields over the launcher's choice for every "
                         "batch (an A/B, e.g. fp8_pairs=0)")
    args = ap.parse_args()
    run = Run(args.out, args.budget)
    device = torch.device(args.device)
    ceil = run.section("ceilings", 10, ceilings, device)
    configs = None
    if args.gemv_configs is not None and not args.gemv_configs.exists():
        print(f"{args.gemv_configs} missing: the default GEMV configs", flush=True)
        run.results["gemv_configs"] = "missing: defaults"
    elif args.gemv_configs is not None:
        from gpu_fp8 import gemv_configs, load_gemv_configs
        configs = load_gemv_configs(args.gemv_configs)
        run.results["gemv_configs"] = {f"{n}x{k}": c._asdict() for (n, k), c in configs.items()}
        print(f"batch-1 fp8 GEMV configs from {args.gemv_configs}: {configs}", flush=True)
    overrides = decode_overrides(args.decode_config)
    if overrides:
        run.results["decode_config"] = overrides
        print(f"decode attention with {overrides} over DecodeConfig.for_batch", flush=True)
    with (contextlib.nullcontext() if configs is None else gemv_configs(configs),
          decode_config(overrides)):
        workloads = run_ours(run, args, ceil)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if workloads is not None and not args.skip_hf:
        mc, p1, o1, p2, o2 = workloads
        hf = run.section("hf_build", 30, lambda: hf_model(mc, torch.bfloat16, device=args.device))
        if hf is not None and not isinstance(hf, dict):
            run.section("hf_T2_b64", 40, hf_generate, hf, p2[:64], o2[:64], device)
            run.section("hf_T1_b64", 35, hf_generate, hf, p1[:64], o1[:64], device)
            if len(p1) >= 256:
                run.section("hf_T1_b256", 40, hf_generate, hf, p1[:256], o1[:256], device)
    report(run.results)
    run.save()


def run_ours(run: Run, args: argparse.Namespace, ceil: dict) -> tuple | None:
    """Our sections; returns (model config, T1 prompts, outputs, T2 prompts, outputs) for HF.
    The engine is freed when this returns."""
    engine = run.section("build", 60, lambda: build_engine(build(EngineConfig,
        model=f"dummy:{args.shape}", dtype="bfloat16", device=args.device,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=max(args.batch, args.max_num_seqs),
        max_num_batched_tokens=8192,
        max_model_len=2048, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype)))
    if engine is None or isinstance(engine, dict):
        return None
    run.results["build"] = {"graphs": sorted(engine.runner.graphs),
                            "seconds": round(time.monotonic() - run.t0, 1)}
    ours = Ours(engine, ceil)
    mc = engine.model_config
    run.results["shape"] = {"name": args.shape, "weight_bytes": ours.weight_bytes,
                            "kv_bytes_per_token": ours.kv_bytes_per_token,
                            "quantization": args.quantization,
                            "kv_cache_dtype": args.kv_cache_dtype}
    sections = set(args.sections.split(","))

    def section(name: str, need: float, fn, *a) -> object:
        return run.section(name, need, fn, *a) if name in sections else None

    section("T3", 20, ours.decode_steps, 1, 512, 129, 64)
    t4 = section("T4", 40, ours.decode_steps, args.batch, 512, 257, 128)
    # T4's run is `batch` requests of T1's workload: it bounds T1's time per request (T1 runs
    # more of them at once).
    per_req = t4["seconds"] / args.batch if t4 and "seconds" in t4 else 0.1
    reserve = 130 if sections & {"T2", "T6", "T7"} or not args.skip_hf else 15  # for the rest
    n1 = min(args.prompts, max(args.batch, int((run.left() - reserve) / per_req) // 64 * 64))
    p1, o1 = uniform(n1, 512, 256, mc.vocab_size, seed=11)

    def t1() -> dict:
        r = ours.offline(p1, o1)
        r["floor_prefill_s"], r["floor_decode_s"] = ours.offline_floor_parts(
            p1, o1, engine.config.scheduler.max_num_seqs)
        r["floor_s"] = r["floor_prefill_s"] + r["floor_decode_s"]
        r["max_num_seqs"] = engine.config.scheduler.max_num_seqs
        r["floor_tok_s"] = sum(o1) / r["floor_s"]
        r["scaled_down_from"] = args.prompts if n1 < args.prompts else None
        return r

    section("T1", per_req * n1 + 10, t1)
    p2, o2 = sharegpt_like(args.prompts, mc.vocab_size)
    n2 = min(args.prompts, max(64, int((run.left() - 120) / per_req * 1.5) // 64 * 64))
    p2, o2 = p2[:n2], o2[:n2]
    section("T2", per_req * n2 / 1.5 + 10, lambda: ours.offline(p2, o2))
    section("T6", 15, ours.prefix_ttft)
    section("T7", 10, ours.handoff)
    return mc, p1, o1, p2, o2


def report(r: dict) -> None:
    def get(name: str, key: str) -> float | None:
        return r.get(name, {}).get(key) if isinstance(r.get(name), dict) else None

    hf_best = max((get(k, "tok_s") or 0.0 for k in ("hf_T1_b64", "hf_T1_b256")), default=0.0)
    shape = r.get("shape", {})
    print(f"ours: weights {shape.get('quantization') or 'bf16'}, KV cache "
          f"{shape.get('kv_cache_dtype', 'auto')}; ceilings {r.get('ceilings')}")
    rows = []
    for name, target in (("T3", "<= 4.0 ms"), ("T4", "<= 11 ms")):
        step, floor, replay = get(name, "engine_step_ms"), get(name, "floor_ms"), \
            get(name, "graph_replay_ms")
        roof = get(name, "roofline_ms") or floor
        if step:
            rows.append((f"{name} decode step b{get(name, 'batch')} ctx {get(name, 'context')}",
                         target, f"{step:.2f} ms (graph {replay or float('nan'):.2f})",
                         f"{floor:.2f} ms (roofline {roof:.2f})", "-",
                         f"floor/step {floor / step:.2f} ({roof / step:.2f})"))
    if get("T1", "tok_s"):
        t1 = get("T1", "tok_s")
        rows.append((f"T1 offline {get('T1', 'requests')}x512/256", ">= 13k tok/s, >= 4x HF",
                     f"{t1:,.0f} tok/s", f"{get('T1', 'floor_tok_s'):,.0f} tok/s",
                     f"HF best {hf_best:,.0f}" if hf_best else "-",
                     f"{t1 / get('T1', 'floor_tok_s'):.2f} of floor"
                     + (f", {t1 / hf_best:.1f}x HF" if hf_best else "")))
    if get("T2", "tok_s"):
        t2, hf64 = get("T2", "tok_s"), get("hf_T2_b64", "tok_s")
        rows.append((f"T2 ShareGPT-like x{get('T2', 'requests')}", ">= 15x HF b64",
                     f"{t2:,.0f} tok/s", "-", f"HF b64 {hf64:,.0f}" if hf64 else "-",
                     f"{t2 / hf64:.1f}x HF" if hf64 else "-"))
    if get("T6", "ratio"):
        rows.append(("T6 TTFT 500 shared + 100 new", "cached <= 1/3",
                     f"{get('T6', 'cached_ms'):.1f} vs {get('T6', 'uncached_ms'):.1f} ms",
                     "-", "-", f"{get('T6', 'ratio'):.2f}"))
    if get("T7", "fraction_of_prefill") is not None:
        rows.append(("T7 handoff 512 tokens", "<= 5% of prefill",
                     f"{get('T7', 'export_import_ms'):.3f} ms ({get('T7', 'copy_tb_s'):.2f} TB/s)",
                     f"prefill {get('T7', 'prefill_ms'):.1f} ms", "-",
                     f"{100 * get('T7', 'fraction_of_prefill'):.2f}%"))
    head = ("target", "goal", "measured", "floor", "peer", "ratio")
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(6)]
    for line in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)))
    r["table"] = [dict(zip(head, row, strict=True)) for row in rows]
    if get("T1", "decode_phase_s") is not None and get("T1", "floor_decode_s"):
        print(f"T1 phases: prefill (chunks and mixed steps) {get('T1', 'prefill_phase_s'):.2f} s "
              f"in {get('T1', 'prefill_phase_steps')} steps, floor "
              f"{get('T1', 'floor_prefill_s'):.2f} s; decode {get('T1', 'decode_phase_s'):.2f} s "
              f"in {get('T1', 'decode_phase_steps')} steps, roofline "
              f"{get('T1', 'floor_decode_s'):.2f} s")


if __name__ == "__main__":
    main()
