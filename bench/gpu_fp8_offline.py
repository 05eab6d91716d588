"""The fp8-pool decode attention compiled for sm_90 without a GPU (issue 19): registers, shared
memory, spills and the SASS of the tile loop, by launch (no device time).

Triton compiles for a GPUTarget without a device and carries ptxas and cuobjdump. The launch's
specialisation is given by hand: pointers and the pool's strides divisible by 16 (as the
runtime finds them), one split's `num_splits == 1` as a constant. With the device's triton
(3.6.0: `pip download --no-deps triton==3.6.0`, unzip, PYTHONPATH=that folder) this gave the
H200's own counts for the byte-wise read (162 registers, 74 KB; Nsight Compute, tenth session).

    PYTHONPATH=/tmp/t36:. python3 bench/gpu_fp8_offline.py

Thirteenth session, triton 3.6 (registers, shared KiB, loop instructions a thread a tile):
bytes 162 / 72.5 / 1258; pairs 162 / 40.5 / 734; pairs_r128 128 / 40.5 / 770 (7 spill stores);
pf (table ahead) 168 / 72 / 734; pf_w8 80 / 72 / 472; pf_bn64_st4 96 / 54 / 456 (a 64-token
tile).
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).parent.parent))
from kernels import decode_attention as da  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_SASS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")

# name: (block_n, warps, stages, maxnreg, PAIRS, PREFETCH)
LAUNCHES = {
    "bytes": (128, 4, 3, None, False, False),
    "pairs": (128, 4, 3, None, True, False),
    "pairs_r128": (128, 4, 3, 128, True, False),
    "pf": (128, 4, 3, None, True, True),
    "pf_w8": (128, 8, 3, None, True, True),
    "pf_bn64_st4": (64, 4, 4, None, True, True),
}


def compile_decode(block_n: int, warps: int, stages: int, maxnreg: int | None, pairs: bool,
                   prefetch: bool, single: bool = True):
    """_decode_split_kernel at llama-3-8b's shape (32 / 8 heads of 128, blocks of 16), bf16 q
    on an fp8 pool, one split (or several with the fused merge)."""
    kv = "*i16" if pairs else "*fp8e4nv"
    types = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "tables_ptr": "*i32",
             "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "acc_ptr": "*fp32", "max_ptr": "*fp32",
             "sum_ptr": "*fp32", "tickets_ptr": "*i32", "qk_scale": "fp32"}
    consts = dict(NUM_HEADS=32, GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16,
                  BLOCK_N=block_n, SINGLE_SPLIT=single, DOT_PRECISION="tf32", F16_DOT=True,
                  FUSED_MERGE=True, MERGE_G=4, CHUNK_S=32, WIDEN_V_FIRST=True, PEEL=False,
                  SAME_KV_STRIDES=True, ASM_WIDEN=False, PAIRS=pairs, COMPILED=True,
                  PREFETCH=prefetch)
    if single:
        consts.update(num_splits=1, ws_splits=1)
    sig, attrs = {}, {}
    for i, name in enumerate(inspect.signature(da._decode_split_kernel.fn).parameters):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name, "i32")
        if (sig[name].startswith("*") or name.startswith("stride")) and name != "stride_tb":
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    src = ASTSource(fn=da._decode_split_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def resources(kernel) -> tuple[dict, str]:
    """({registers, local bytes, shared KB}, SASS) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        usage = subprocess.run([BIN / "cuobjdump", "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([BIN / "cuobjdump", "--dump-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", usage, re.S)
    return {"registers": int(m.group(1)), "local": int(m.group(2)),
            "shared_kb": kernel.metadata.shared / 1024}, sass


def tile_loop(sass: str) -> collections.Counter:
    """Opcodes of the largest loop (a backward branch) in the SASS: the tile loop."""
    rows = [(int(m.group(1), 16), m.group(2).split(".")[0], line)
            for line in sass.splitlines() if (m := _SASS.match(line))]
    best: collections.Counter = collections.Counter()
    for addr, op, line in rows:
        target = re.search(r"BRA .*?0x([0-9a-f]+)", line) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            ops = collections.Counter(o for a, o, _ in rows
                                      if int(target.group(1), 16) <= a <= addr)
            if sum(ops.values()) > sum(best.values()):
                best = ops
    return best


def main() -> None:
    print(f"triton {triton.__version__}, sm_90")
    for name, launch in LAUNCHES.items():
        res, sass = resources(compile_decode(*launch))
        loop = tile_loop(sass)
        print(f"{name:<12} regs {res['registers']:>3}  shared {res['shared_kb']:5.1f} KB  "
              f"spill stores {sass.count('STL')}  loop {sum(loop.values())} instructions: "
              + ", ".join(f"{o} {c}" for o, c in loop.most_common(8)), flush=True)


if __name__ == "__main__":
    main()
