"""A cheap checksum of KV blocks, computed where the tensor lives (CPU or GPU).

    words      the block's bytes read as int32 (the pool's own bytes: any dtype)
    s_j, q_j   sum of words and sum of squared words of block j, in int64 (wrapping mod 2**64)
    checksum   sum over j of (j + 1) * (s_j + M * q_j)  mod 2**64, as a signed int64,
               with M = 0x9E3779B97F4A7C15 and j the block's position in the transfer

Integer sums are exact and order-independent, so the source (on its device) and the receiver (on
its own) agree bit for bit; the position weight catches swapped or repeated blocks, the squares
catch changes that keep a block's plain sum. It is a guard against stale or misrouted blocks,
not a cryptographic hash.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from common.engine.uploads import to_device
from common.kv_transport.blocks import BLOCK_AXIS, check_pool
from kernels import block_sums_cpu

_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_MASK = (1 << 64) - 1
_CHUNK_BYTES = 2 << 20                  # blocks gathered per pass (a thread keeps 3x this)


def kv_checksum(pool: torch.Tensor, block_ids: Sequence[int]) -> int:
    """Checksum of pool's blocks block_ids, in that order (pool: [layers, 2, blocks, ...]).

    On a GPU: one upload of the ids, one kernel, one read of the [n, 2] sums (the step's only
    sync); on a CPU one pass of our C++ kernel on this thread (kernels/block_sums_cpu.py), else
    torch ops; the weighting and the sum run here, on n pairs of ints."""
    check_pool(pool)
    if (pool.shape[-1] * pool.element_size()) % 4:
        raise ValueError(f"head_dim * itemsize must be a multiple of 4 bytes, pool {pool.shape}")
    index = to_device(block_ids, torch.long, pool.device)
    if pool.is_cuda and pool.is_contiguous():
        from kernels.block_sums import block_sums  # CPU-only processes never load Triton
        with torch.cuda.device(pool.device):  # Triton launches on the current device
            sums = block_sums(pool, index)
    elif block_sums_cpu.serves(pool):
        sums = block_sums_cpu.block_sums(pool, index)
    else:
        sums = block_sums_torch(pool, index)
    return combine(sums.tolist())


def prepare(pool: torch.Tensor) -> None:
    """Builds the CPU kernel now if pool is a CPU pool (a service's start-up), so that the first
    handoff does not wait for a compiler."""
    if pool.device.type == "cpu":
        block_sums_cpu.available()


def combine(sums: Sequence[Sequence[int]]) -> int:
    """The checksum from each block's (sum of words, sum of squared words), as int64 arithmetic
    wrapping mod 2**64 would give it (the module docstring's formula)."""
    total = sum(j * (s + _MIX * q) for j, (s, q) in enumerate(sums, start=1)) & _MASK
    return total - (1 << 64) if total >> 63 else total


def block_sums_torch(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[n, 2] int64: (sum of words, sum of squared words) of each listed block, in passes of
    at most _CHUNK_BYTES of gathered blocks (the CPU path, and the GPU kernel's reference).

    The passes gather into, and widen to int64 in, this thread's scratch buffers, kept from one
    call to the next: fresh temporaries of this size come from new pages each call, and on a
    virtual machine their page faults cost five times the arithmetic (a 32-block SmolLM2 handoff
    in the services: ~150 ms of system time against ~30 ms of sums)."""
    block_elems = pool[:, :, 0].numel()
    block_words = block_elems * pool.element_size() // 4
    per_pass = max(1, min(index.numel(), _CHUNK_BYTES // (4 * block_words)))
    gathered, wide = _scratch(pool, per_pass * block_elems, per_pass * block_words)
    sums = torch.empty(index.numel(), 2, dtype=torch.int64, device=pool.device)
    for start in range(0, index.numel(), per_pass):
        ids = index[start:start + per_pass]
        k = ids.numel()
        # [layers, 2, k, block_size, kv_heads, head_dim], then each block's words in one row
        blocks = gathered[:k * block_elems].view(*pool.shape[:2], k, *pool.shape[3:])
        torch.index_select(pool, BLOCK_AXIS, ids, out=blocks)
        words = blocks.view(torch.int32).movedim(BLOCK_AXIS, 0)
        rows = wide[:k * block_words].view(words.shape)
        rows.copy_(words)
        rows = rows.view(k, block_words)
        sums[start:start + k, 0] = rows.sum(1)
        sums[start:start + k, 1] = rows.mul_(rows).sum(1)
    return sums


_scratch_local = threading.local()


def _scratch(pool: torch.Tensor, elements: int, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's buffers for block_sums_torch, at least `elements` of the pool's dtype and
    `words` int64 on its device (grown when a call needs more; one pair per device and dtype,
    so concurrent callers on other threads never share them)."""
    key = (pool.device, pool.dtype)
    have = getattr(_scratch_local, "buffers", None)
    if have is None:
        have = _scratch_local.buffers = {}
    pair = have.get(key)
    if pair is None or pair[0].numel() < elements or pair[1].numel() < words:
        pair = have[key] = (torch.empty(elements, dtype=pool.dtype, device=pool.device),
                            torch.empty(words, dtype=torch.int64, device=pool.device))
    return pair
