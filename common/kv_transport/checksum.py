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

from collections.abc import Sequence

import torch

from common.kv_transport.blocks import BLOCK_AXIS, check_pool
from common.uploads import to_device

_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_MASK = (1 << 64) - 1
_CHUNK_BYTES = 16 << 20                 # blocks summed per pass, to bound temporary memory


def kv_checksum(pool: torch.Tensor, block_ids: Sequence[int]) -> int:
    """Checksum of pool's blocks block_ids, in that order (pool: [layers, 2, blocks, ...]).

    On a GPU: one upload of the ids, one kernel, one read of the [n, 2] sums (the step's only
    sync); the weighting and the sum run here, on n pairs of ints."""
    check_pool(pool)
    if (pool.shape[-1] * pool.element_size()) % 4:
        raise ValueError(f"head_dim * itemsize must be a multiple of 4 bytes, pool {pool.shape}")
    index = to_device(block_ids, torch.long, pool.device)
    if pool.is_cuda and pool.is_contiguous():
        from kernels.block_sums import block_sums  # CPU-only processes never load Triton
        with torch.cuda.device(pool.device):  # Triton launches on the current device
            sums = block_sums(pool, index)
    else:
        sums = block_sums_torch(pool, index)
    return combine(sums.tolist())


def combine(sums: Sequence[Sequence[int]]) -> int:
    """The checksum from each block's (sum of words, sum of squared words), as int64 arithmetic
    wrapping mod 2**64 would give it (the module docstring's formula)."""
    total = sum(j * (s + _MIX * q) for j, (s, q) in enumerate(sums, start=1)) & _MASK
    return total - (1 << 64) if total >> 63 else total


def block_sums_torch(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[n, 2] int64: (sum of words, sum of squared words) of each listed block, in passes of
    at most _CHUNK_BYTES of gathered blocks (the CPU path, and the GPU kernel's reference)."""
    block_bytes = pool[:, :, 0].numel() * pool.element_size()
    per_pass = max(1, _CHUNK_BYTES // block_bytes)
    parts = [torch.zeros(0, 2, dtype=torch.int64, device=pool.device)]
    for start in range(0, index.numel(), per_pass):
        blocks = pool.index_select(BLOCK_AXIS, index[start:start + per_pass])  # contiguous copy
        words = blocks.view(torch.int32).to(torch.int64)
        dims = (0, 1, 3, 4, 5)
        parts.append(torch.stack([words.sum(dim=dims), (words * words).sum(dim=dims)], dim=1))
    return torch.cat(parts)
