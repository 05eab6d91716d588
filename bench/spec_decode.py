"""n-gram speculative decoding on SmolLM2 (CPU): decode speedup over plain decoding, same run.

Input-grounded prompts (rewrite code with one change, repeat a list with one item changed,
summarise a passage by quoting it), greedy, at batch 1 and batch 16. One engine serves both
variants: plain requests opt out of speculation (SamplingParams.speculative=False), so weights,
KV pool and threads are shared, and the two are run interleaved, repeat after repeat, because
the CPU is shared with other work. Decode time runs from the step where every request of the
batch has its first token to the last step; both variants produce the same tokens (checked).

    .venv/bin/python bench/spec_decode.py --json bench/results/spec_decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build, leaf

CODE = [
    ("rename the function `area` to `rectangle_area`",
     "def area(width, height):\n    \"\"\"Area of a rectangle.\"\"\"\n    if width < 0 or height < 0:"
     "\n        raise ValueError(\"negative size\")\n    return width * height\n\n\n"
     "def total_area(shapes):\n    return sum(area(w, h) for w, h in shapes)\n"),
    ("make `greet` print the name in upper case",
     "def greet(name):\n    message = \"Hello, \" + name + \"!\"\n    print(message)\n"
     "    return message\n\n\nfor person in [\"Ada\", \"Alan\", \"Grace\"]:\n    greet(person)\n"),
    ("change the loop to count down from 10",
     "count = 0\nfor i in range(10):\n    if i % 2 == 0:\n        count += i\n"
     "        print(\"even\", i)\n    else:\n        print(\"odd\", i)\nprint(\"total\", count)\n"),
    ("add a default value of 1 to the parameter `step`",
     "def walk(start, stop, step):\n    position = start\n    path = []\n"
     "    while position < stop:\n        path.append(position)\n        position += step\n"
     "    return path\n"),
    ("return an empty list instead of None",
     "def find_words(text, letter):\n    if not text:\n        return None\n"
     "    words = text.split()\n    return [w for w in words if w.startswith(letter)]\n"),
    ("use a dictionary instead of a list for `scores`",
     "scores = []\nfor name, points in [(\"red\", 3), (\"blue\", 5), (\"green\", 2)]:\n"
     "    scores.append((name, points))\nbest = max(scores, key=lambda item: item[1])\n"
     "print(\"winner:\", best[0])\n"),
]
LISTS = [
    ("bananas", "mangoes", "apples, bananas, cherries, dates, elderberries, figs, grapes, kiwis"),
    ("Tuesday", "Holiday", "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday"),
    ("violin", "trumpet", "piano, violin, cello, flute, clarinet, oboe, harp, guitar, drums"),
    ("Paris", "Lyon", "Berlin, Madrid, Paris, Rome, Vienna, Lisbon, Prague, Warsaw, Dublin"),
    ("copper", "silver", "iron, copper, zinc, tin, lead, nickel, cobalt, aluminium, titanium"),
]
PASSAGES = [
    "The library opened in 1902 with four hundred books donated by local families. Over the "
    "next century it grew to hold more than two million volumes. In 1987 a fire destroyed the "
    "east wing, and the collection was rebuilt with help from libraries across the country.",
    "Honey bees communicate the location of flowers through a waggle dance. The angle of the "
    "dance shows the direction relative to the sun, and its length shows the distance. A "
    "single colony can visit millions of flowers in one season.",
    "The bridge took six years to build and was finished in 1937. At the time it was the "
    "longest suspension bridge in the world. Its towers rise 227 metres above the water, and "
    "its main cables contain enough wire to circle the earth three times.",
    "Tomatoes were once thought to be poisonous in parts of Europe. They arrived from the "
    "Americas in the sixteenth century and were grown only as decoration. By the nineteenth "
    "century they had become a common ingredient in Italian cooking.",
    "The first marathon runners in the modern Olympics ran 40 kilometres in 1896. The distance "
    "was fixed at 42.195 kilometres in 1921. Today more than a million people finish a "
    "marathon every year.",
]


def build_prompts(tokenizer) -> list[list[int]]:
    """16 chat-templated, input-grounded prompts."""
    texts = [f"Rewrite this code with one change: {change}. Output only the code.\n\n"
             f"```python\n{code}```" for change, code in CODE]
    texts += [f"Repeat this list with one item changed: replace {old} with {new}.\n\n{items}"
              for old, new, items in LISTS]
    texts += [f"Summarise this passage by quoting its key sentences word for word.\n\n{p}"
              for p in PASSAGES]
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], add_generation_prompt=True), add_special_tokens=False)
        for t in texts]


@dataclass
class Run:
    decode_s: float
    decode_tokens: int    # output tokens after each request's first
    decode_seq_steps: int  # (sequence, step) pairs that emitted decode tokens
    drafts: int
    draft_tokens: int
    accepted: int


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
        ) -> tuple[Run, list[list[int]]]:
    before = engine.spec_counters
    before = (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens)
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    started = None
    seq_steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if started is not None and out.new_token_ids:
                seq_steps += 1
            tokens[out.request_id] += out.new_token_ids
        if started is None and all(tokens.values()):
            started = time.perf_counter()
    elapsed = time.perf_counter() - started
    c = engine.spec_counters
    outputs = [tokens[rid] for rid in ids]
    return Run(elapsed, sum(len(t) - 1 for t in outputs), seq_steps,
               c.num_drafts - before[0], c.num_draft_tokens - before[1],
               c.num_accepted_tokens - before[2]), outputs


def summarise(runs: list[Run]) -> dict:
    total = Run(*(sum(getattr(r, f) for r in runs) for f in Run.__dataclass_fields__))
    return {"decode_s": total.decode_s, "decode_tokens": total.decode_tokens,
            "decode_tok_per_s": total.decode_tokens / total.decode_s,
            "tokens_per_target_forward": total.decode_tokens / total.decode_seq_steps,
            "accepted_per_verification": total.accepted / total.drafts if total.drafts else 0.0,
            "acceptance_rate": total.accepted / total.draft_tokens if total.draft_tokens else 0.0,
            "runs": [asdict(r) for r in runs]}


def measure(engine: LLMEngine, prompts: list[list[int]], batch: int, repeats: int,
            max_tokens: int) -> dict:
    """Interleaved plain / n-gram repeats; a batch-1 repeat runs each prompt alone in turn."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    variants = {name: SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative=spec)
                for name, spec in (("plain", False), ("ngram", True))}
    per_repeat: dict[str, list[Run]] = {name: [] for name in variants}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for name, params in variants.items():
            runs = [run(engine, group, params) for group in groups]
            per_repeat[name].append(Run(*(sum(getattr(r, f) for r, _ in runs)
                                          for f in Run.__dataclass_fields__)))
            outputs[name] = [o for _, outs in runs for o in outs]
    speedups = [p.decode_s / s.decode_s
                for p, s in zip(per_repeat["plain"], per_repeat["ngram"], strict=True)]
    return {"batch": batch, "requests": len(prompts),
            "identical": outputs["plain"] == outputs["ngram"],
            "speedup_median": statistics.median(speedups), "speedups": speedups,
            **{name: summarise(runs) for name, runs in per_repeat.items()}}


def main() -> None:
    defaults = EngineConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--batch1-prompts", type=int, default=4,
                    help="prompts run one at a time for batch 1 (of the 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=defaults.speculative.num_tokens)
    ap.add_argument("--prompt-lookup-min", type=int, default=defaults.speculative.prompt_lookup_min)
    ap.add_argument("--prompt-lookup-max", type=int, default=defaults.speculative.prompt_lookup_max)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1 is fastest on a CPU shared with other work)")
    ap.add_argument("--cpu-linear", default=defaults.model.cpu_linear,
                    help=leaf(EngineConfig, "cpu_linear").help)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(build(EngineConfig,
        speculative_method="ngram", num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        num_kv_blocks=1024, max_num_batched_tokens=4096, enable_prefix_caching=False,
        cpu_linear=args.cpu_linear))
    assert engine.tokenizer is not None
    prompts = build_prompts(engine.tokenizer)
    run(engine, prompts[:2], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        # Batch 1 takes an even spread of the three kinds of prompt.
        step = max(1, len(prompts) // args.batch1_prompts)
        chosen = prompts[::step][:args.batch1_prompts] if batch == 1 else prompts
        results.append(measure(engine, chosen, batch, args.repeats, args.max_tokens))
        r = results[-1]
        print(f"batch {batch}: speedups {' '.join(f'{s:.2f}' for s in r['speedups'])}",
              flush=True)
    print(f"\nSmolLM2-135M-Instruct, CPU ({torch.get_num_threads()} threads), greedy, "
          f"{args.max_tokens} new tokens, k={args.num_speculative_tokens}, "
          f"n-gram {args.prompt_lookup_min}..{args.prompt_lookup_max}, "
          f"{args.repeats} interleaved repeats")
    print("| batch | requests | plain tok/s | ngram tok/s | speedup (median) | speedups | "
          "tokens/target forward | accepted/verification | acceptance | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        p, s = r["plain"], r["ngram"]
        print(f"| {r['batch']} | {r['requests']} | {p['decode_tok_per_s']:.1f} | "
              f"{s['decode_tok_per_s']:.1f} | {r['speedup_median']:.2f}x | "
              f"{' '.join(f'{x:.2f}' for x in r['speedups'])} | "
              f"{s['tokens_per_target_forward']:.2f} | {s['accepted_per_verification']:.2f} | "
              f"{s['acceptance_rate']:.0%} | {r['identical']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": str(date.today()), "machine": platform.node(),
            "threads": torch.get_num_threads(), "settings": vars(args) | {"json": str(args.json)},
            "results": results}, indent=1))


if __name__ == "__main__":
    main()
