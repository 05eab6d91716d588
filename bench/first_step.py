"""A handed-off request's first decode step on the engine alone, the floor under the stack's
token 1 -> 2 gap (bench/stack_latency.py) without the services around the engine.

A request joins the engine as the decode service admits one: its prompt's blocks reserved
(kv.reserve_for_copy) and handed over with its first token (Prefilled), while the engine is
idle or while other streams decode. The script times, per request: the launch of the first
step that holds it (its host time, and how much of that built the step's input), and when its
second token comes out of step(), from add_request; beside it the engine's steady ITL in the
same run. The KV blocks hold whatever was there (timing only). Prints a table, writes JSON.

    python bench/first_step.py --model dummy:llama-3-8b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine, Prefilled
from common.flags import build


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:tiny-llama", help="model (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="engine device (default %(default)s)")
    parser.add_argument("--dtype", default="float32", help="weights' dtype (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="the handed-off prompt's length (default %(default)s)")
    parser.add_argument("--requests", type=int, default=10,
                        help="handed-off requests per case (default %(default)s)")
    parser.add_argument("--streams", type=int, default=1,
                        help="streams decoding in the busy case (default %(default)s)")
    parser.add_argument("--num-kv-blocks", type=int, default=1024,
                        help="KV blocks (default %(default)s)")
    parser.add_argument("--out", default="first_step.json", help="JSON path (default %(default)s)")
    args = parser.parse_args()

    engine = LLMEngine(build(EngineConfig, model=args.model, device=args.device,
                             dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
                             max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=2048))
    launches: list[tuple[float, float, float]] = []  # (start, seconds, input seconds)
    engine.runner.step_listeners.append(
        lambda t: launches.append((t.start, t.seconds, t.built - t.start)))
    block = engine.config.cache.block_size
    counter = iter(range(10**9))

    def handed_off(max_tokens: int = 2) -> tuple[str, float]:
        rid = f"h{next(counter)}"
        blocks, after = engine.kv.reserve_for_copy(-(-args.prompt_tokens // block))
        if after is not None:
            after.synchronize()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompt = [1 + i % 100 for i in range(args.prompt_tokens)]
        start = time.perf_counter()
        engine.add_request(rid, prompt, params, Prefilled(blocks, 7))
        return rid, start

    def until_done(rid: str, start: float) -> dict:
        first = len(launches)
        token2 = None
        while token2 is None:
            for out in engine.step():
                if out.request_id == rid and out.new_token_ids and token2 is None:
                    token2 = time.perf_counter()
        begin, seconds, building = launches[first]
        return {"wake_ms": 1e3 * (begin - start), "launch_ms": 1e3 * seconds,
                "input_ms": 1e3 * building, "token2_ms": 1e3 * (token2 - start)}

    def drain() -> None:
        while engine.has_unfinished():
            engine.step()

    # Warm-up: graphs, kernels, the sampler.
    for _ in range(3):
        until_done(*handed_off())
        drain()
    idle = []
    for _ in range(args.requests):
        idle.append(until_done(*handed_off()))
        drain()
    # Busy: other streams decode; the handed-off request joins between two steps.
    prompt = [5] * 64
    for i in range(args.streams):
        engine.add_request(f"busy{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=1900, ignore_eos=True))
    for _ in range(5):
        engine.step()
    busy, steps = [], []
    for _ in range(args.requests):
        t = time.perf_counter()
        for _ in range(3):
            engine.step()
        steps.append(1e3 * (time.perf_counter() - t) / 3)
        busy.append(until_done(*handed_off()))
    for i in range(args.streams):
        engine.abort(f"busy{i}")
    drain()
    itl = p50(steps)
    rows = {"idle": idle, f"{args.streams} streams": busy}
    print(f"{args.model} on {args.device} ({args.dtype}), {args.prompt_tokens}-token prompts; "
          f"steady step with {args.streams} streams: {itl:.2f} ms")
    print(f"{'case':12} {'wake':>7} {'launch':>7} {'input':>7} {'token 2':>8} {'/ ITL':>6}")
    result = {"model": args.model, "device": args.device, "dtype": args.dtype,
              "prompt_tokens": args.prompt_tokens, "itl_ms_p50": itl, "cases": {}}
    for name, runs in rows.items():
        med = {k: p50([r[k] for r in runs]) for k in runs[0]}
        result["cases"][name] = {"p50": med, "runs": runs}
        print(f"{name:12} {med['wake_ms']:7.2f} {med['launch_ms']:7.2f} {med['input_ms']:7.2f} "
              f"{med['token2_ms']:8.2f} {med['token2_ms'] / itl:6.2f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
