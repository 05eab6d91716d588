"""Resident memory of one CPU engine process against its weights and the KV pool it touched
(issue 18's limit: RSS <= 1.2 x (weights + KV pool touched)).

Each dtype runs in a fresh process (`--child`), so no figure carries what an earlier engine's
allocator kept: torch imported (the runtime's own RSS), the engine built (num_kv_blocks 4096, as
bench/cpu_throughput.py), one built-in workload run, then RSS, the model's weights (its
parameters' bytes, as loaded; a projection held packed only counts once), the extra copies the
CPU ops hold (oneDNN packed copies beside a weight), the pool's size and the pool's resident
pages (its mapping's Rss in /proc/self/smaps: the pool is allocated uninitialised, so pages no
sequence wrote are not resident).

    .venv/bin/python bench/cpu_memory.py --dtypes float32,bfloat16 --workload sharegpt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _mapping_rss(address: int) -> int:
    """Bytes resident of the /proc/self/smaps mapping holding address."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    return 0


def child(dtype: str, workload: str, num_requests: int) -> dict:
    import psutil
    import torch

    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.flags import build
    from common.models.ops_onednn import OneDnnLinear

    sys.path.insert(0, str(ROOT / "bench"))
    from cpu_throughput import make_workload, run_ours

    mib = 2**20
    runtime = psutil.Process().memory_info().rss
    engine = LLMEngine(build(EngineConfig, num_kv_blocks=4096, dtype=dtype))
    w = make_workload(workload, num_requests, engine.model_config.vocab_size)
    seconds, _ = run_ours(engine, w, 1)
    model = engine.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    held_only = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_meta)
    linear = model.ops.linear
    extra = 0
    if isinstance(linear, OneDnnLinear):
        extra = sum(torch.ops.mkldnn._nbytes(packed) for _, _, packed in linear._packed.values())
    pool = engine.runner.kv_cache
    touched = _mapping_rss(pool.data_ptr())
    rss = psutil.Process().memory_info().rss
    return {"dtype": dtype, "workload": workload, "requests": num_requests,
            "run_s": round(seconds, 2), "rss_mib": round(rss / mib),
            "runtime_rss_mib": round(runtime / mib),
            "weights_mib": round(weights / mib), "held_packed_only_mib": round(held_only / mib),
            "packed_copies_beside_weights_mib": round(extra / mib),
            "kv_pool_mib": round(pool.numel() * pool.element_size() / mib),
            "kv_pool_touched_mib": round(touched / mib),
            "rss_over_weights_plus_touched": round(rss / (weights + touched), 2),
            "rss_less_runtime_over_weights_plus_touched":
                round((rss - runtime) / (weights + touched), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.workload, args.num_requests)))
        return
    rows = []
    for dtype in args.dtypes.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", dtype, "--workload",
                              args.workload, "--num-requests", str(args.num_requests)],
                             cwd=ROOT, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
