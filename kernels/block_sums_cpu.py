"""The KV checksum's per-block sums on the CPU (block_sums_cpu.cpp), read in place from the pool
on the calling thread, and a handoff's copy with them in one pass (copy_block_sums: the shm
transport's pull). The path when this does not build is common.kv_transport.checksum's torch
ops; `reference` is the plain one (tests/kernels/test_block_sums.py compares all three).

One thread, on purpose: the sums run on the handoff's critical path, beside an engine that keeps
both cores busy. The torch path's gather, widen and reduce are OpenMP regions of two threads,
and with another process on a core they wait on each other (four SmolLM2 blocks: 1.8 ms on one
thread, 92 ms on two under load, 2026-12-03, AVX2 box). This reads each block's words once, no
gather and no scratch: a 64-token SmolLM2 prompt (4 blocks, 2.9 MiB) in the figures of
bench/RESULTS.md's tenth-session section.

Compiled on first use for this CPU (-march=native) and cached on disk (kernels.cpu_build); the
services build it at start-up (`available()` from the KV source and the decode's inbox), not on
their first handoff.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from kernels.cpu_build import cpu_tag, load

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")


@functools.cache
def available() -> bool:
    """The kernel is built (now, if it was not) and gives the reference's sums here."""
    if os.name != "posix" or not SOURCE.is_file():
        return False
    try:
        load(f"splitserve_block_sums_{cpu_tag()}", SOURCE, ["-O3", "-march=native"])
        return _self_check()
    except (OSError, RuntimeError, ImportError, AssertionError) as e:
        log.warning("the CPU block sums kernel is not available (%s): the checksum runs torch "
                    "ops", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


def reference(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """block_sums in plain torch, one block at a time (the tests' and the self-check's)."""
    rows = []
    for block in index.tolist():
        words = pool[:, :, block].contiguous().view(torch.int32).reshape(-1).to(torch.int64)
        rows.append(torch.stack((words.sum(), (words * words).sum())))
    return torch.stack(rows) if rows else torch.empty(0, 2, dtype=torch.int64)


def _self_check() -> bool:
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(3, 2, 5, 4, 2, 8, generator=g)
    index = torch.tensor([4, 0, 2], dtype=torch.long)
    dst = torch.zeros(3, 2, 4, 4, 2, 8)
    copied = copy_block_sums(pool, dst, index, torch.tensor([1, 3, 0]))
    want = reference(pool, index)
    return (torch.equal(block_sums(pool, index), want) and torch.equal(copied, want)
            and torch.equal(dst[:, :, [1, 3, 0]], pool[:, :, [4, 0, 2]]))


def serves(pool: torch.Tensor) -> bool:
    """Whether block_sums takes this pool (else: the torch path)."""
    return pool.device.type == "cpu" and pool.is_contiguous() and available()


def block_sums(pool: torch.Tensor,    # [layers, 2, blocks, ...] contiguous, any dtype
               index: torch.Tensor,   # [n] int64 block ids
               ) -> torch.Tensor:     # [n, 2] int64: sum of words, sum of squared words
    out = torch.empty(index.numel(), 2, dtype=torch.int64)
    torch.ops.splitserve_block_sums.block_sums(pool, index.contiguous(), out)
    return out


def copy_block_sums(src: torch.Tensor,      # [layers, 2, blocks_src, ...] contiguous
                    dst: torch.Tensor,      # [layers, 2, blocks_dst, ...] contiguous, src's dtype
                    src_ids: torch.Tensor,  # [n] int64
                    dst_ids: torch.Tensor,  # [n] int64, distinct
                    ) -> torch.Tensor:      # [n, 2] int64: block_sums of what was copied
    """dst[:, :, dst_ids[j]] = src[:, :, src_ids[j]], and each copied block's sums from the
    words as they were read: one pass, one thread."""
    ids = torch.stack((src_ids.to(torch.long), dst_ids.to(torch.long)))
    out = torch.empty(ids.shape[1], 2, dtype=torch.int64)
    torch.ops.splitserve_block_sums.copy_block_sums(src, dst, ids, out)
    return out
