"""Structured outputs' cost on CPU (SmolLM2-135M-Instruct, float32, in-process LLMEngine): 64
JSON-schema requests against 64 unconstrained ones of the same output lengths, batch 32.

The constrained run goes first (greedy, four schemas in turn, max_tokens 96) and fixes each
request's output length; the unconstrained run generates exactly those lengths (EOS ignored,
max_tokens = that length), so both produce the same token count from the same prompts. The two
runs then alternate `--rounds` times on one engine (the box's noise is ~20% between runs of one
setting, bench/RESULTS.md, and other processes on it only ever slow a run); each mode's figure
is its best round. Throughput is output tokens
over the wall time of the whole 64-request workload (prefills and grammar compiles included; a
compile is cached after the first round). The mask's own cost per step, fill on the host plus
the apply, is timed apart at batch 1, 32 and 256 on real matchers; `--mask-only` times only
that, on CPU or CUDA, with no model (a GPU box needs only torch, tokenizers, jinja2, xgrammar).

    .venv/bin/python bench/structured_throughput.py --out bench/results/structured_throughput_2026-12-01.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

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


def timed(eng: LLMEngine, ps: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = eng.generate(ps, params)
    return time.perf_counter() - start, outs


def mask_cost(cache: GrammarCache, tokenizer: Tokenizer, batch: int, device: str = "cpu",
              steps: int = 50) -> float:
    """Microseconds per step for fill (host) + apply over `batch` constrained rows of the vocab
    (on CUDA: until the apply has run, the step's own sync)."""
    future = cache.get(StructuredOutput("json", json.dumps(SCHEMAS[0])))
    future.result()
    states = []
    for _ in range(batch):
        s = GrammarState(future, tokenizer.eos_token_ids)
        s.activate(tokenizer.encode('{"name": "', add_special_tokens=False))
        states.append(s)
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
                 steps: int = 30) -> dict[str, float]:
    """Microseconds per Sampler call (greedy) over `batch` rows, all constrained or none,
    the two timed in alternation so that other load on the box falls on both alike."""
    from common.engine.core.sequence import Sequence
    from common.engine.sampler import Sampler

    future = cache.get(StructuredOutput("json", json.dumps(SCHEMAS[0])))
    future.result()
    head = tokenizer.encode('{"name": "', add_special_tokens=False)
    plain = [Sequence(f"p{i}", [1], SamplingParams(temperature=0.0)) for i in range(batch)]
    constrained = [Sequence(f"c{i}", [1], SamplingParams(temperature=0.0)) for i in range(batch)]
    for seq in constrained:
        seq.grammar = GrammarState(future, tokenizer.eos_token_ids)
        seq.grammar.activate(head)
    sampler = Sampler()
    logits = torch.randn(batch, cache.vocab_size, device=device)
    total = {"unconstrained": 0.0, "json_schema": 0.0}
    for i in range(steps + 2):
        for mode, seqs in (("unconstrained", plain), ("json_schema", constrained)):
            start = time.perf_counter()
            sampler(logits, seqs)  # waits for the tokens: the step's one sync
            if i >= 2:
                total[mode] += time.perf_counter() - start
    return {mode: t / steps * 1e6 for mode, t in total.items()}


def mask_only(tokenizer_dir: Path, device: str) -> dict[str, dict]:
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
    return {"mask_us_per_step": masks, "sampler_us_per_step": samplers}


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
    args = ap.parse_args()
    if args.mask_only is not None:
        costs = mask_only(args.mask_only, args.device)
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

    eng = LLMEngine(build(EngineConfig, num_kv_blocks=1024, max_num_seqs=args.batch,
                          cpu_threads=args.cpu_threads, device="cpu"))
    ps = prompts(eng, args.requests)
    constrained = [SamplingParams(max_tokens=96, temperature=0.0, structured=StructuredOutput(
        "json", json.dumps(SCHEMAS[i % len(SCHEMAS)]))) for i in range(args.requests)]
    first_s, outs = timed(eng, ps, constrained)
    lengths = [len(o.output_token_ids) for o in outs]
    valid = sum(1 for o in outs if o.finish_reason == "stop" and _parses(o.text))
    free = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in lengths]
    seconds: dict[str, list[float]] = {"json_schema": [first_s], "unconstrained": []}
    for r in range(args.rounds):  # constrained, unconstrained, constrained, ...
        seconds["unconstrained"].append(timed(eng, ps, free)[0])
        if r < args.rounds - 1:
            seconds["json_schema"].append(timed(eng, ps, constrained)[0])
    tokens = sum(lengths)
    tps = {mode: tokens / min(s) for mode, s in seconds.items()}
    ratio = tps["json_schema"] / tps["unconstrained"]
    masks = {b: mask_cost(eng.grammars, eng.tokenizer, b) for b in (1, 32, 256)}

    print(f"{args.requests} requests, batch {args.batch}, {tokens} output tokens each run, "
          f"{valid}/{args.requests} constrained outputs valid JSON")
    print("| mode | runs (s) | best output tok/s |")
    print("|---|---|---|")
    for mode, s in seconds.items():
        print(f"| {mode} | {', '.join(f'{x:.1f}' for x in s)} | {tps[mode]:.1f} |")
    print(f"constrained / unconstrained: {ratio:.3f}")
    print("mask per step (fill + apply, CPU): "
          + ", ".join(f"batch {b}: {us:.0f} us" for b, us in masks.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": args.cpu_threads,
            "requests": args.requests, "batch": args.batch, "output_tokens": tokens,
            "lengths": lengths, "valid": valid, "seconds": seconds, "tokens_per_s": tps,
            "ratio": ratio, "mask_us_per_step": masks}, indent=2))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


if __name__ == "__main__":
    main()
