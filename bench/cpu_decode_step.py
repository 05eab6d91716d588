"""One CPU decode step of SmolLM2 at a given batch and context, and its attention alone.

The pool holds random K/V (blocks shuffled, as a busy pool's are); every sequence has the same
context length. Prints the median of --iters forwards (the model's, with logits) and of the
attention backend's calls over all layers, with the decode kernel (kernels.cpu_decode_attention)
and without it (each sequence's context gathered), the two interleaved so that a busy box
slows both alike.

    flock /tmp/splitserve-bench.lock .venv/bin/python bench/cpu_decode_step.py --batch 32 --ctx 450
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.flags import build
from common.models.attention import AttentionMetadata
from kernels import cpu_decode_attention


def decode_meta(batch: int, ctx: int, block_size: int, num_blocks: int,
                seed: int = 0) -> AttentionMetadata:
    per_seq = -(-ctx // block_size)
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = torch.tensor([ids[b * per_seq:(b + 1) * per_seq] for b in range(batch)],
                          dtype=torch.int32)
    last = ctx - 1
    slots = tables[:, last // block_size].long() * block_size + last % block_size
    return AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32), block_tables=tables,
        num_decodes=batch, num_decode_tokens=batch, max_query_len=1, max_seq_len=ctx)


def interleaved_ms(fn, iters: int) -> dict[str, float]:
    """Median ms of fn() with the decode kernel and without it, alternating."""
    serves = cpu_decode_attention.serves
    paths = {"kernel": serves, "gathered": lambda q, k_cache: False}
    times: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for i in range(iters + 1):
            for name, choice in paths.items():
                cpu_decode_attention.serves = choice
                t = time.perf_counter()
                fn()
                if i:  # the first round warms up
                    times[name].append(time.perf_counter() - t)
    finally:
        cpu_decode_attention.serves = serves
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=450)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    block_size = 16
    num_blocks = args.batch * -(-args.ctx // block_size) + 8
    engine = LLMEngine(build(EngineConfig, num_kv_blocks=num_blocks, dtype=args.dtype,
                             block_size=block_size))
    runner, model = engine.runner, engine.model
    torch.manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape) * 0.5)
    meta = decode_meta(args.batch, args.ctx, block_size, num_blocks)
    mc = engine.model_config
    ids = torch.randint(100, mc.vocab_size, (args.batch,))
    pos = torch.full((args.batch,), args.ctx - 1, dtype=torch.long)
    q = torch.randn(args.batch, mc.num_heads, mc.head_dim, dtype=runner.dtype)

    def step() -> None:
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, runner.kv_cache, meta, runner.backend))

    def attention() -> None:
        with torch.inference_mode():
            for layer in runner.kv_cache:
                runner.backend.forward(q, layer[0], layer[1], meta, mc.head_dim ** -0.5)

    print(f"batch {args.batch}, context {args.ctx}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, medians of {args.iters}:")
    for what, fn in (("step", step), (f"attention, {mc.num_layers} layers", attention)):
        ms = interleaved_ms(fn, args.iters)
        print(f"  {what}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))


if __name__ == "__main__":
    main()
