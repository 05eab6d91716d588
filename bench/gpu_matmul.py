"""The decode step's matmuls alone: each projection of a dummy shape at the batch sizes the
engine runs, through each BLAS library torch offers, against the roofline.

For every (projection, rows M) it times F.linear(x[M, K], W[N, K]) in a CUDA graph of back-to-
back calls that rotate over enough weight copies to defeat the L2, and reports the time, the
bandwidth (weight bytes / time), the FLOP rate and the fraction of the roofline floor
max(weight bytes / copy bandwidth, FLOPs / matmul rate), for torch's default library and for
each library `torch.backends.cuda.preferred_blas_library` accepts.

    PYTHONPATH=. python3 bench/gpu_matmul.py --out matmul.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from common.models.dummy import dummy_config

LIBRARIES = ("default", "cublas", "cublaslt")


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the weight, as the engine fuses them."""
    c = dummy_config(shape)
    return {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o": (c.hidden_size, c.q_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}


def time_linear(n: int, k: int, m: int, copies: int, reps: int = 5) -> float:
    """Median microseconds of one F.linear, from graph replays of `copies` calls on distinct
    weights (so each call reads its weight from DRAM)."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for w in weights:
        F.linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            F.linear(x, w)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 128, 256])
    ap.add_argument("--copy-tb-s", type=float, default=4.27)
    ap.add_argument("--matmul-tflops", type=float, default=790.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    results = []
    print("| library | proj | M | us | TB/s | TFLOP/s | of roofline |\n|---|---|---|---|---|---|---|")
    for lib in LIBRARIES:
        if lib != "default":
            try:
                torch.backends.cuda.preferred_blas_library(lib)
            except Exception as e:  # noqa: BLE001 - a library this build lacks
                print(f"{lib}: unavailable ({e})")
                continue
        for name, (n, k) in projections(args.shape).items():
            copies = max(2, int(512e6 // (n * k * 2)))
            for m in args.rows:
                us = time_linear(n, k, m, copies)
                nbytes, flops = n * k * 2, 2 * m * n * k
                floor = max(nbytes / (args.copy_tb_s * 1e12), flops / (args.matmul_tflops * 1e12))
                row = {"library": lib, "proj": name, "m": m, "n": n, "k": k, "us": us,
                       "tb_s": nbytes / us / 1e6, "tflops": flops / us / 1e6,
                       "of_roofline": floor * 1e6 / us}
                results.append(row)
                print(f"| {lib} | {name} | {m} | {us:.1f} | {row['tb_s']:.2f} | "
                      f"{row['tflops']:.0f} | {row['of_roofline']:.2f} |")
    torch.backends.cuda.preferred_blas_library("cublas")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
