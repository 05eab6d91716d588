"""Nano-batch overlap of a decode step: can attention (bandwidth-bound) run beside matmuls
(compute-bound) on the H200? A probe for T1 and T4 (bench/NOTES.md, "What stands between").

Builds the 8B-shape model and a KV pool through the engine (no graphs of its own), puts `batch`
decode rows of `context` tokens into the runner's persistent buffers (each row its own blocks,
shuffled over the pool), and captures three CUDA graphs of the same decode step:

    plain     one stream, all rows: embed, 32 x (qkv + attention, o + gate_up + down), norm,
              lm_head (the runner's decode graph, written out phase by phase)
    free      two streams, half the rows each, every phase in turn; the streams meet at the end
    lockstep  two streams, half A one phase ahead of half B: B's attention of layer L waits for
              A's, and A's attention of layer L + 1 waits for B's, so each half's attention runs
              while the other half's o/gate_up/down matmuls do

and times replays with CUDA events (median of --reps). The logits of each variant are compared
with plain's (same rows, same inputs; the half-batch matmuls may round differently). The K/V
pool is left as allocated (unwritten), so the times are below the engine's at the same shapes:
the ratios between the variants are the result.

Outcome on the H200 (bench/NOTES.md, 2026-12-01): two streams were slower at every batch size.

    PYTHONPATH=. python3 bench/gpu_overlap.py --batch 256 512 1024 --out overlap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from common.engine.config import EngineConfig
from common.engine.cuda_runner import CudaGraphRunner
from common.engine.engine import LLMEngine
from common.flags import build
from common.models.attention import AttentionMetadata
from common.models.attention_triton import TritonAttentionBackend
from kernels.decode_attention import DecodeConfig, DecodeWorkspace, default_num_splits

sys.path.insert(0, str(Path(__file__).parent))
from gpu_perf import ceilings, event_ms  # noqa: E402


class Rows:
    """One nano-batch: rows [lo, hi) of the runner's buffers, its attention backend, its state."""

    def __init__(self, runner: CudaGraphRunner, lo: int, hi: int):
        n = hi - lo
        mc, dev = runner.mc, runner.device
        self.runner, self.n = runner, n
        self.ids = runner.input_ids.dev[lo:hi]
        self.positions = runner.positions.dev[lo:hi]
        width = runner.max_blocks * runner.block_size
        self.meta = AttentionMetadata(
            slot_mapping=runner.slot_mapping.dev[lo:hi],
            query_start_loc=runner.query_start_loc.dev[:n + 1],  # arange: only its shape counts
            seq_lens=runner.seq_lens.dev[lo:hi], block_tables=runner.block_tables.dev[lo:hi],
            num_decodes=n, num_decode_tokens=n, max_query_len=1, max_seq_len=width)
        config = DecodeConfig.for_batch(n, mc.num_kv_heads, dev)
        splits = default_num_splits(n, mc.num_kv_heads, width, dev, config)
        ws = (DecodeWorkspace.allocate(n, mc.num_heads, mc.head_dim, splits, dev)
              if splits > 1 else None)
        self.backend = TritonAttentionBackend(decode_splits=splits, decode_config=config,
                                              decode_workspace=ws)
        self.h = self.residual = self.o = self.logits = None

    def start(self) -> None:
        self.h = F.embedding(self.ids, self.runner.model.embed_tokens.weight)
        self.residual = None

    def attention(self, i: int) -> None:
        model = self.runner.model
        layer, ops, cache = model.layers[i], model.ops, self.runner.kv_cache[i]
        attn, norm = layer.self_attn, layer.input_layernorm
        q, self.residual = ops.norm_qkv_rotary_store(
            self.h, self.residual, norm.weight, norm.eps, attn.qkv_proj.weight,
            attn.qkv_proj.bias, self.positions, model.cos_sin, cache[0], cache[1], self.meta,
            self.backend, attn.heads)
        self.o = self.backend.forward(q, cache[0], cache[1], self.meta, attn.scale)

    def mlp(self, i: int) -> None:
        model = self.runner.model
        layer, ops = model.layers[i], model.ops
        attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        h = ops.linear(self.o.reshape(self.n, attn.q_size), attn.o_proj.weight, None)
        gate_up, self.residual = ops.norm_linear(h, self.residual, norm.weight, norm.eps,
                                                 mlp.gate_up_proj.weight, None)
        self.h = ops.act_linear(gate_up, mlp.down_proj.weight, None)

    def finish(self) -> None:
        model = self.runner.model
        h, _ = model.ops.rms_norm(self.h, model.norm.weight, model.norm.eps, self.residual)
        self.logits = model.compute_logits(h)


def forward_plain(rows: list[Rows]) -> None:
    (r,) = rows
    r.start()
    for i in range(len(r.runner.model.layers)):
        r.attention(i)
        r.mlp(i)
    r.finish()


def forward_two(rows: list[Rows], lockstep: bool) -> None:
    a, b = rows
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    layers = len(a.runner.model.layers)
    a_attn = [torch.cuda.Event() for _ in range(layers)]
    b_attn = [torch.cuda.Event() for _ in range(layers)]
    a.start()
    with torch.cuda.stream(side):
        b.start()
    for i in range(layers):
        if lockstep and i:
            main.wait_event(b_attn[i - 1])
        a.attention(i)
        a_attn[i].record(main)
        a.mlp(i)
        with torch.cuda.stream(side):
            if lockstep:
                side.wait_event(a_attn[i])
            b.attention(i)
            b_attn[i].record(side)
            b.mlp(i)
    a.finish()
    with torch.cuda.stream(side):
        b.finish()
    main.wait_stream(side)


def fill_rows(runner: CudaGraphRunner, batch: int, context: int, seed: int) -> None:
    """batch decode rows at position context - 1, each with its own shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    bs = runner.block_size
    per_row = -(-context // bs)
    if batch * per_row > runner.num_blocks:
        raise SystemExit(f"{batch} x {per_row} blocks do not fit the pool of {runner.num_blocks}")
    blocks = torch.randperm(runner.num_blocks, generator=g)[:batch * per_row].view(batch, per_row)
    runner.block_tables.dev[:batch].zero_()
    runner.block_tables.dev[:batch, :per_row].copy_(blocks.to(torch.int32))
    pos = context - 1
    runner.slot_mapping.dev[:batch].copy_(blocks[:, pos // bs] * bs + pos % bs)
    runner.positions.dev[:batch].fill_(pos)
    runner.seq_lens.dev[:batch].fill_(context)
    runner.input_ids.dev[:batch].copy_(
        torch.randint(min(1000, runner.mc.vocab_size // 2), runner.mc.vocab_size - 1, (batch,),
                      generator=g))
    n = runner.query_start_loc.dev.shape[0]
    runner.query_start_loc.dev.copy_(torch.arange(n, dtype=torch.int32))


@torch.inference_mode()
def probe(runner: CudaGraphRunner, batch: int, context: int, reps: int) -> dict:
    fill_rows(runner, batch, context, seed=batch)
    half = batch // 2
    variants = {"plain": ([Rows(runner, 0, batch)], forward_plain),
                "free": ([Rows(runner, 0, half), Rows(runner, half, batch)],
                         lambda r: forward_two(r, lockstep=False)),
                "lockstep": ([Rows(runner, 0, half), Rows(runner, half, batch)],
                             lambda r: forward_two(r, lockstep=True))}
    out: dict = {"batch": batch, "context": context}
    reference = None
    for name, (rows, fn) in variants.items():
        fn(rows)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(rows)
        graph.replay()
        torch.cuda.synchronize()
        logits = torch.cat([r.logits for r in rows])
        if reference is None:
            reference = logits.clone()
        times = event_ms(graph.replay, reps)
        out[name] = {
            "replay_ms": statistics.median(times), "spread_ms": [min(times), max(times)],
            "argmax_agree": float((logits.argmax(-1) == reference.argmax(-1)).float().mean()),
            "max_abs_diff": float((logits - reference).abs().max())}
        print(f"  b{batch} ctx {context} {name:9s} {out[name]['replay_ms']:7.2f} ms "
              f"(argmax agree {out[name]['argmax_agree']:.3f})", flush=True)
        del graph, rows
        torch.cuda.synchronize()
    plain = out["plain"]["replay_ms"]
    out["speedup"] = {k: plain / out[k]["replay_ms"] for k in ("free", "lockstep")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--context", type=int, nargs="+", default=[640])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--num-kv-blocks", type=int, default=45000)
    args = ap.parse_args()
    config = build(EngineConfig, model=f"dummy:{args.shape}", dtype="bfloat16", device="cuda",
                          num_kv_blocks=args.num_kv_blocks, max_num_seqs=max(args.batch),
                          max_num_batched_tokens=max(args.batch), max_model_len=2048,
                          cuda_graph_prefill_tokens=0)
    engine = LLMEngine(config, runner_factory=lambda *a, **k: CudaGraphRunner(
        *a, use_cuda_graphs=False, **k))
    results = {"ceilings": ceilings(engine.device), "cases": []}
    for context in args.context:
        for batch in args.batch:
            results["cases"].append(probe(engine.runner, batch, context, args.reps))
            args.out.write_text(json.dumps(results, indent=1))
    print(f"{'batch':>6} {'ctx':>5} {'plain ms':>9} {'free':>14} {'lockstep':>14}")
    for c in results["cases"]:
        print(f"{c['batch']:>6} {c['context']:>5} {c['plain']['replay_ms']:>9.2f} "
              + " ".join(f"{c[k]['replay_ms']:>7.2f} ({c['speedup'][k]:.2f}x)"
                         for k in ("free", "lockstep")))


if __name__ == "__main__":
    main()
