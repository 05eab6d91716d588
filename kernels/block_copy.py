"""Copy a list of KV blocks between two pools (or within one): prefill -> decode handoff and
copy-on-write.

A pool is viewed as [outer, num_blocks, inner]: outer = the dimensions before the block
dimension (layers, k/v), inner = the contiguous block contents (block_size * kv_heads * head_dim).
One program copies one chunk of one block pair for one outer index, in wide vector loads.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import cdiv, check_tensor


@dataclass(frozen=True, slots=True)
class CopyConfig:
    chunk: int = 2048      # elements per program (4 KiB of bf16; 94% vs 92% for 4096 on H200)
    num_warps: int = 4


@triton.jit
def _copy_blocks_kernel(
    src_ptr,               # [OUTER, num_blocks_src, INNER]
    dst_ptr,               # [OUTER, num_blocks_dst, INNER]
    src_ids_ptr, dst_ids_ptr,  # [n] int64
    src_outer, src_block, dst_outer, dst_block,  # strides in elements
    INNER: tl.constexpr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    pair = pid // CHUNKS
    offs = (pid % CHUNKS) * CHUNK + tl.arange(0, CHUNK)
    outer = tl.program_id(1).to(tl.int64)
    s = tl.load(src_ids_ptr + pair)
    d = tl.load(dst_ids_ptr + pair)
    mask = offs < INNER
    x = tl.load(src_ptr + outer * src_outer + s * src_block + offs, mask=mask)
    tl.store(dst_ptr + outer * dst_outer + d * dst_block + offs, x, mask=mask)


def copy_blocks(src: torch.Tensor,        # [..., num_blocks_src, block_size, kv_heads, head_dim]
                dst: torch.Tensor,        # [..., num_blocks_dst, block_size, kv_heads, head_dim]
                src_ids: torch.Tensor,    # [n] int64
                dst_ids: torch.Tensor,    # [n] int64
                block_dim: int = -4,
                *,
                config: CopyConfig | None = None) -> None:
    """Same effect as torch_ops.copy_blocks: dst[..., dst_ids[i], ...] = src[..., src_ids[i],
    ...]. Ids must be in range and dst_ids distinct; src and dst may be the same pool if no id
    is both read and written."""
    config = config or CopyConfig()
    dev = src.device
    check_tensor("src", src, unit_last_stride=False)
    bd = block_dim % src.dim()
    if dst.dim() != src.dim() or block_dim % dst.dim() != bd:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ in rank")
    if src.shape[:bd] != dst.shape[:bd] or src.shape[bd + 1:] != dst.shape[bd + 1:]:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ outside the "
                         f"block dimension {bd}")
    check_tensor("dst", dst, dtypes=(src.dtype,), device=dev, unit_last_stride=False)
    check_tensor("src_ids", src_ids, dim=1, dtypes=(torch.int64,), device=dev)
    check_tensor("dst_ids", dst_ids, shape=tuple(src_ids.shape), dtypes=(torch.int64,), device=dev)
    n = src_ids.shape[0]
    inner = math.prod(src.shape[bd + 1:])
    outer = math.prod(src.shape[:bd])
    if n == 0 or inner == 0 or outer == 0:
        return
    if src.dtype == torch.float8_e4m3fn:  # moved as bytes: a copy converts nothing
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    s3 = _view3(src, bd, "src")  # [outer, num_blocks_src, inner]
    d3 = _view3(dst, bd, "dst")
    chunk = min(config.chunk, triton.next_power_of_2(inner))
    chunks = cdiv(inner, chunk)
    _copy_blocks_kernel[(n * chunks, outer)](
        s3, d3, src_ids, dst_ids, s3.stride(0), s3.stride(1), d3.stride(0), d3.stride(1),
        INNER=inner, CHUNKS=chunks, CHUNK=chunk, num_warps=config.num_warps,
    )


def copy_listed_blocks(src: torch.Tensor, dst: torch.Tensor,
                       src_ids: Sequence[int], dst_ids: Sequence[int], block_dim: int = -4,
                       *, config: CopyConfig | None = None) -> None:
    """copy_blocks with the block ids as host lists, as callers that own the block tables have
    them: range-checked here (the kernel would not notice a bad id), sent up in one pinned,
    non-blocking copy (no wait for the device), and launched on the pools' device whatever the
    calling thread's current device is."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    bd = block_dim % src.dim()
    for name, ids, t in (("src_ids", src_ids, src), ("dst_ids", dst_ids, dst)):
        if ids and not 0 <= min(ids) <= max(ids) < t.shape[bd]:
            raise IndexError(f"{name} outside [0, {t.shape[bd]})")
    on_cuda = src.device.type == "cuda"
    host = torch.tensor([list(src_ids), list(dst_ids)], dtype=torch.int64, pin_memory=on_cuda)
    ids = host.to(src.device, non_blocking=on_cuda)
    with torch.cuda.device(src.device) if on_cuda else contextlib.nullcontext():
        copy_blocks(src, dst, ids[0], ids[1], block_dim, config=config)


def _view3(t: torch.Tensor, bd: int, name: str) -> torch.Tensor:
    """t as [outer, num_blocks, inner], sharing its storage. Each block's contents must be one
    contiguous run; torch.view itself refuses leading dimensions that cannot be merged."""
    run = 1
    for i in range(t.dim() - 1, bd, -1):
        if t.shape[i] != 1 and t.stride(i) != run:
            raise ValueError(f"{name}: each block must be contiguous in memory (shape "
                             f"{tuple(t.shape)}, strides {t.stride()})")
        run *= t.shape[i]
    return t.view(math.prod(t.shape[:bd]), t.shape[bd], run)
