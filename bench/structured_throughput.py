"""Structured outputs' cost on CPU (SmolLM2-135M-Instruct, float32, in-process LLMEngine): 64
JSON-schema requests against 64 unconstrained ones of the same output lengths, batch 32.

A cold run goes first and is reported apart: the constrained workload (greedy, four schemas in
turn, max_tokens 96) on the fresh engine, which pays what a process pays once (xgrammar's import,
the vocabulary's TokenizerInfo, the four compiles, the engine's first-use costs). It fixes each
request's output length; every unconstrained run generates exactly those lengths (EOS ignored,
max_tokens = that length), so each run of either mode produces the same token count from the
same prompts (checked, as is that every constrained run's tokens equal the cold run's). Then
`--rounds` rounds, each one run of each mode on the warm engine, the order alternating between
rounds (the box's noise is ~20% between runs of one setting, bench/RESULTS.md, and other
processes only ever slow a run); each mode's figure is its best round, in wall time and in the
process's CPU time (less sensitive to other load on a shared box). Before this split the
constrained figure was the cold run itself, against warm unconstrained runs: 0.545 on
2026-12-02, most of it the cold run's one-time costs. The mask's own cost per step, the fill on
the host plus the apply, is timed apart at batch 1, 32 and 256 on real matchers at different
points of a document; `--mask-only` times only that and the sampler, on CPU or CUDA, with no
model (a GPU box needs only torch, tokenizers, jinja2, xgrammar); on CUDA it also times a step
whose forward is a stand-in GPU kernel of `--forward-ms`, with and without the mask, which is
what the mask adds to a decode step when its host-side fill runs while the forward does.
`--engine-device cuda` runs the whole comparison on a GPU (overlap scheduling and CUDA graphs, as
a service runs; with `--model dummy:smollm2-135m --tokenizer-dir DIR` on a box without the
weights), and each run's engine launches show whether constrained rows sample at every step.

    flock /tmp/splitserve-bench.lock .venv/bin/python bench/structured_throughput.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from common.engine.core.sampling_params import SamplingParams, StructuredOutput
from common.engine.structured import GrammarCache, GrammarState, TokenMasker
from common.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from common.engine.engine import LLMEngine

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                      "population": {"type": "integer"}},
     "required": ["city", "country", "population"]},
    {"type": "object", "properties": {"title": {"type": "string"},
                                      "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["title", "tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "score": {"type": "number"}}, "required": ["ok", "score"]},
]
TOPICS = ["a person", "a city", "a book", "a test result"]


def prompts(eng: LLMEngine, n: int) -> list[list[int]]:
    tok = eng.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content":
                                                 f"Describe {TOPICS[i % 4]} (number {i}) as JSON."}]),
                       add_special_tokens=False) for i in range(n)]


class Run(NamedTuple):
    wall_s: float
    cpu_s: float  # the process's CPU time (every thread's), time.process_time()
    token_ids: list[list[int]]  # each request's outputs
    steps: int  # engine launches (with overlap scheduling a constrained row that waited for
    #             its token would need about twice as many as an unconstrained run)


def timed(eng: LLMEngine, ps: list[list[int]], params: list[SamplingParams]) -> Run:
    launches = sum(eng.runner.steps.values())
    cpu, start = time.process_time(), time.perf_counter()
    outs = eng.generate(ps, params)
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    return Run(time.perf_counter() - start, time.process_time() - cpu,
               [o.output_token_ids for o in outs], sum(eng.runner.steps.values()) - launches)


DOCUMENT = '{"title": "Dune", "tags": ["science fiction", "classic", "desert"]}'  # SCHEMAS[2]


def document_states(cache: GrammarCache, tokenizer: Tokenizer, batch: int) -> list[GrammarState]:
    """`batch` matchers of SCHEMAS[2], row i some tokens further into DOCUMENT than row i - 1
    (between keys, inside strings, in the array): the mix of masks a batch of decodes sees."""
    future = cache.get(StructuredOutput("json", json.dumps(SCHEMAS[2])))
    future.result()
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    states = []
    for i in range(batch):
        s = GrammarState(future, tokenizer.eos_token_ids)
        assert s.activate(ids[:i % len(ids)])
        states.append(s)
    return states


def mask_cost(cache: GrammarCache, tokenizer: Tokenizer, batch: int, device: str = "cpu",
              steps: int = 50) -> float:
    """Microseconds per step for fill (host) + apply over `batch` constrained rows of the vocab
    (on CUDA: until the apply has run, the step's own sync)."""
    states = document_states(cache, tokenizer, batch)
    masker = TokenMasker()
    logits = torch.randn(batch, cache.vocab_size, device=device)
    rows = list(range(batch))
    for _ in range(3):
        masker.apply(logits, rows, states)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        masker.apply(logits, rows, states)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def sampler_cost(cache: GrammarCache, tokenizer: Tokenizer, batch: int, device: str,
                 steps: int = 30, forward_ms: float = 0.0) -> dict[str, float]:
    """Microseconds per Sampler call (greedy) over `batch` rows, all constrained or none,
    the two timed in alternation so that other load on the box falls on both alike.
    forward_ms (CUDA): each call follows a stand-in forward, a GPU kernel that keeps the device
    busy that long (torch.cuda._sleep), so the figure is a whole step's: the mask's host-side
    fill runs while the device runs the forward, as in the engine."""
    from common.engine.core.sequence import Sequence
    from common.engine.sampler import Sampler

    plain = [Sequence(f"p{i}", [1], SamplingParams(temperature=0.0)) for i in range(batch)]
    constrained = [Sequence(f"c{i}", [1], SamplingParams(temperature=0.0)) for i in range(batch)]
    for seq, state in zip(constrained, document_states(cache, tokenizer, batch), strict=True):
        seq.grammar = state
    sampler = Sampler()
    logits = torch.randn(batch, cache.vocab_size, device=device)
    cycles = _sleep_cycles(forward_ms) if forward_ms else 0
    total = {"unconstrained": 0.0, "json_schema": 0.0}
    for i in range(steps + 2):
        for mode, seqs in (("unconstrained", plain), ("json_schema", constrained)):
            start = time.perf_counter()
            if cycles:
                torch.cuda._sleep(cycles)
            sampler(logits, seqs)  # waits for the tokens: the step's one sync
            if i >= 2:
                total[mode] += time.perf_counter() - start
    return {mode: t / steps * 1e6 for mode, t in total.items()}


def _sleep_cycles(ms: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for `ms` milliseconds (measured)."""
    probe = 10_000_000
    torch.cuda._sleep(probe)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def mask_only(tokenizer_dir: Path, device: str, forward_ms: float) -> dict[str, dict]:
    """The mask's cost alone (no model): for a GPU box without the engine's dependencies."""
    tok = Tokenizer.from_dir(tokenizer_dir)
    cache = GrammarCache(tok, 49152, tok.eos_token_ids)
    masks = {b: mask_cost(cache, tok, b, device) for b in (1, 32, 256)}
    samplers = {b: sampler_cost(cache, tok, b, device) for b in (1, 32, 256)}
    print(f"mask per step (fill + apply, {device}): "
          + ", ".join(f"batch {b}: {us:.0f} us" for b, us in masks.items()))
    for b, us in samplers.items():
        print(f"sampler per step, batch {b} ({device}): unconstrained {us['unconstrained']:.0f} "
              f"us, json_schema {us['json_schema']:.0f} us")
    out = {"mask_us_per_step": masks, "sampler_us_per_step": samplers}
    if device == "cuda":
        steps = {b: sampler_cost(cache, tok, b, device, forward_ms=forward_ms)
                 for b in (1, 32, 256)}
        for b, us in steps.items():
            added = us["json_schema"] / us["unconstrained"] - 1
            print(f"step with a {forward_ms} ms stand-in forward, batch {b}: unconstrained "
                  f"{us['unconstrained']:.0f} us, json_schema {us['json_schema']:.0f} us "
                  f"(the mask adds {100 * added:.1f}%)")
        out["step_us_with_stand_in_forward"] = steps
        out["forward_ms"] = forward_ms
    cache.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="--max-num-seqs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--mask-only", type=Path, default=None, metavar="TOKENIZER_DIR",
                    help="time only the mask, with this tokenizer directory, on --device")
    ap.add_argument("--device", default="cpu", help="for --mask-only: cpu or cuda")
    ap.add_argument("--forward-ms", type=float, default=6.5,
                    help="for --mask-only on CUDA: the stand-in forward's length (the batch-32 "
                         "decode step the mask is judged against)")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct",
                    help="the engine's model; a dummy:<shape> of SmolLM2's vocabulary (e.g. "
                         "dummy:smollm2-135m, random weights) needs --tokenizer-dir")
    ap.add_argument("--engine-device", default="cpu",
                    help="the engine's device: cpu, or cuda (overlap scheduling, CUDA graphs)")
    ap.add_argument("--tokenizer-dir", type=Path, default=None,
                    help="tokenizer of a dummy --model (SmolLM2's tokenizer.json and config)")
    args = ap.parse_args()
    if args.mask_only is not None:
        costs = mask_only(args.mask_only, args.device, args.forward_ms)
        if args.out:
            args.out.write_text(json.dumps({"date": date.today().isoformat(),
                                            "device": args.device, **costs,
                                            "gpu": torch.cuda.get_device_name()
                                            if args.device == "cuda" else None}, indent=2))
        return

    # The engine only here: --mask-only runs where its dependencies (grpc, gguf, ...) are not.
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.flags import build

    eng = LLMEngine(build(EngineConfig, model=args.model, num_kv_blocks=1024,
                          max_num_seqs=args.batch, cpu_threads=args.cpu_threads,
                          device=args.engine_device))
    if eng.tokenizer is None:  # a dummy model: the structured outputs need a vocabulary
        if args.tokenizer_dir is None:
            ap.error(f"{args.model} has no tokenizer: pass --tokenizer-dir")
        eng.tokenizer = Tokenizer.from_dir(args.tokenizer_dir)
        eng.grammars = GrammarCache(eng.tokenizer, eng.model_config.vocab_size,
                                    eng.tokenizer.eos_token_ids)
    ps = prompts(eng, args.requests)
    constrained = [SamplingParams(max_tokens=96, temperature=0.0, structured=StructuredOutput(
        "json", json.dumps(SCHEMAS[i % len(SCHEMAS)]))) for i in range(args.requests)]
    launches = sum(eng.runner.steps.values())
    cpu, start = time.process_time(), time.perf_counter()
    outs = eng.generate(ps, constrained)
    cold = Run(time.perf_counter() - start, time.process_time() - cpu,
               [o.output_token_ids for o in outs], sum(eng.runner.steps.values()) - launches)
    lengths = [len(t) for t in cold.token_ids]
    valid = sum(1 for o in outs if o.finish_reason == "stop" and _parses(o.text))
    free = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in lengths]
    # mixed: every other request constrained, the rest free, in one batch (with overlap
    # scheduling a constrained row once waited a launch for its token while free rows went on).
    mixed = [constrained[i] if i % 2 == 0 else free[i] for i in range(args.requests)]
    runs: dict[str, list[Run]] = {"unconstrained": [], "json_schema": [], "mixed": []}
    differ = []  # CUDA: constrained requests whose warm tokens differ from the cold run's
    for r in range(args.rounds):  # the modes' order rotates from round to round
        order = [("unconstrained", free), ("json_schema", constrained), ("mixed", mixed)]
        for mode, params in order[r % 3:] + order[:r % 3]:
            run = timed(eng, ps, params)
            ruled = [i for i, p in enumerate(params) if p.structured is not None]
            off = sum(run.token_ids[i] != cold.token_ids[i] for i in ruled)
            if off:
                if eng.device.type != "cuda":  # float32 on CPU: token-identical
                    raise RuntimeError(f"a warm {mode} run's constrained tokens differ from the "
                                       "cold run's")
                # bf16 on random weights: near-ties flip with the batch's composition, so a
                # request may take another (valid) path of another length; each run's own
                # token count then gives its rate.
                differ.append((mode, off))
            elif [len(t) for t in run.token_ids] != lengths:
                raise RuntimeError(f"a {mode} run's output lengths differ from the cold run's")
            runs[mode].append(run)
    tokens = sum(lengths)
    tps = {mode: max(sum(map(len, r.token_ids)) / r.wall_s for r in rs)
           for mode, rs in runs.items()}
    cpu_tps = {mode: max(sum(map(len, r.token_ids)) / r.cpu_s for r in rs)
               for mode, rs in runs.items()}
    ratio = tps["json_schema"] / tps["unconstrained"]
    cpu_ratio = cpu_tps["json_schema"] / cpu_tps["unconstrained"]
    masks = {b: mask_cost(eng.grammars, eng.tokenizer, b) for b in (1, 32, 256)}  # host

    print(f"{args.requests} requests, batch {args.batch}, {tokens} output tokens in the cold run "
          f"and in every run of the same tokens (checked), {valid}/{args.requests} constrained "
          f"outputs valid JSON (the rest reach max_tokens 96)")
    print(f"cold constrained run (xgrammar import, compiles, first use): {cold.wall_s:.1f} s "
          f"wall, {cold.cpu_s:.1f} s CPU")
    print(f"engine: {args.model} on {eng.device} ({eng.dtype}), overlap scheduling "
          f"{'on' if eng.overlap else 'off'}")
    print("| mode (warm) | runs, wall s | runs, CPU s | launches per run | best output tok/s "
          "(wall) |")
    print("|---|---|---|---|---|")
    for mode, rs in runs.items():
        print(f"| {mode} | {', '.join(f'{r.wall_s:.2f}' for r in rs)} | "
              f"{', '.join(f'{r.cpu_s:.1f}' for r in rs)} | "
              f"{', '.join(str(r.steps) for r in rs)} | {tps[mode]:.1f} |")
    if differ:
        print(f"warm runs whose constrained tokens differ from the cold run's (bf16 near-ties), "
              f"(mode, requests): {differ}; rates use each run's own token count")
    print(f"constrained / unconstrained: {ratio:.3f} by wall time, {cpu_ratio:.3f} by CPU time; "
          f"mixed / unconstrained: {tps['mixed'] / tps['unconstrained']:.3f}")
    print("mask per step (fill + apply, CPU): "
          + ", ".join(f"batch {b}: {us:.0f} us" for b, us in masks.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": args.cpu_threads,
            "model": args.model, "device": str(eng.device), "overlap": eng.overlap,
            "gpu": torch.cuda.get_device_name() if eng.device.type == "cuda" else None,
            "launches": {m: [r.steps for r in rs] for m, rs in runs.items()},
            "load_average": os.getloadavg(), "requests": args.requests, "batch": args.batch,
            "output_tokens": tokens, "lengths": lengths, "valid": valid,
            "cold": {"wall_s": cold.wall_s, "cpu_s": cold.cpu_s},
            "wall_s": {m: [r.wall_s for r in rs] for m, rs in runs.items()},
            "cpu_s": {m: [r.cpu_s for r in rs] for m, rs in runs.items()},
            "tokens_per_s": tps, "ratio": ratio, "cpu_ratio": cpu_ratio,
            "constrained_requests_differing_per_run": differ,
            "mask_us_per_step": masks}, indent=2))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


if __name__ == "__main__":
    main()
