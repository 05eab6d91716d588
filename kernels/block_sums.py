"""Per-block integer sums of KV blocks in one pass over the pool: the handoff checksum's GPU path.

For block j of the list, over every 32-bit word w of its bytes (all layers, K and V):

    s_j = sum(w)      q_j = sum(w * w)      in int64, wrapping mod 2**64

which the torch path of common.kv_transport.checksum computes with a gathered copy and int64
temporaries of every word (its reference; tests/kernels/test_block_sums.py compares the two). One program reads one chunk of one block for one (layer, K/V) index and adds its two
partial sums to the block's totals with atomics; integer addition is associative mod 2**64, so
the result does not depend on the order and equals the reference bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.checks import cdiv, check_tensor

CHUNK = 2048  # words per program


@triton.jit
def _block_sums_kernel(
    src_ptr,               # [OUTER, num_blocks_src, INNER] int32
    dst_ptr,               # [OUTER, num_blocks_dst, INNER] int32 (COPY only)
    ids_ptr,               # [n] int64 source ids, then (COPY) [n] destination ids
    sums_ptr,              # [n, 2] int64, zero at launch
    n, src_outer, src_block, dst_outer, dst_block,
    INNER: tl.constexpr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr, COPY: tl.constexpr,
):
    pid = tl.program_id(0)
    j = pid // CHUNKS
    offs = (pid % CHUNKS) * CHUNK + tl.arange(0, CHUNK)
    outer = tl.program_id(1).to(tl.int64)
    mask = offs < INNER
    s = tl.load(ids_ptr + j)
    w = tl.load(src_ptr + outer * src_outer + s * src_block + offs, mask=mask, other=0)
    if COPY:  # the words just read go to the destination block too
        d = tl.load(ids_ptr + n + j)
        tl.store(dst_ptr + outer * dst_outer + d * dst_block + offs, w, mask=mask)
    w = w.to(tl.int64)
    tl.atomic_add(sums_ptr + 2 * j, tl.sum(w, axis=0))
    tl.atomic_add(sums_ptr + 2 * j + 1, tl.sum(w * w, axis=0))


def block_sums(pool: torch.Tensor,   # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
               block_ids: torch.Tensor,  # [n] int64, on the pool's device, in range
               ) -> torch.Tensor:        # [n, 2] int64: (s_j, q_j)
    """(s_j, q_j) per listed block. The pool must be contiguous and its last dimension a whole
    number of 32-bit words."""
    check_tensor("pool", pool, dim=6)
    if not pool.is_contiguous():
        raise ValueError("block_sums needs a contiguous pool")
    if (pool.shape[-1] * pool.element_size()) % 4:
        raise ValueError(f"head_dim * itemsize must be a multiple of 4 bytes, pool {pool.shape}")
    check_tensor("block_ids", block_ids, dim=1, dtypes=(torch.int64,), device=pool.device)
    layers, kv, num_blocks = pool.shape[:3]
    words = pool.view(torch.int32).view(layers * kv, num_blocks, -1)
    inner = words.shape[2]
    n = block_ids.shape[0]
    sums = torch.zeros(n, 2, dtype=torch.int64, device=pool.device)
    if n == 0:
        return sums
    chunks = cdiv(inner, CHUNK)
    _block_sums_kernel[(n * chunks, layers * kv)](
        words, words, block_ids, sums, n, words.stride(0), words.stride(1),
        words.stride(0), words.stride(1),
        INNER=inner, CHUNKS=chunks, CHUNK=CHUNK, COPY=False, num_warps=4)
    return sums


def copy_block_sums(src: torch.Tensor,  # [layers, 2, num_blocks_src, block_size, kv_heads, head_dim]
                    dst: torch.Tensor,  # the same but num_blocks_dst; same dtype and device
                    ids: torch.Tensor,  # [2, n] int64 on the device: source ids, destination ids
                    out: torch.Tensor | None = None,  # [n, 2] int64 zeros on the device, or None
                    ) -> torch.Tensor:  # [n, 2] int64: (s_j, q_j) of each copied block
    """Copy blocks src[:, :, ids[0, j]] -> dst[:, :, ids[1, j]] and return the sums block_sums
    would give of what was copied, in one pass: each word is read once, written once and summed
    from the register it was read into (a handoff's copy and its verification in one kernel).
    Both pools contiguous; ids in range and destination ids distinct (not checked here). out:
    where the sums go, zeroed by the caller."""
    if out is None:
        out = torch.zeros(ids.shape[1] if ids.dim() == 2 else 0, 2, dtype=torch.int64,
                          device=src.device)
    return prepare_copy_block_sums(src, dst, ids, out)()


def prepare_copy_block_sums(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor,
                            out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """copy_block_sums in two parts: the checks and the pools' word views now; the returned
    launch queues only the kernel on the current stream (out zeroed by the caller) and returns
    out. For a launch that must be quick once its moment comes (an early handoff's copy,
    decode_service/handoff.py); the tensors must outlive it."""
    check_tensor("src", src, dim=6)
    check_tensor("dst", dst, dim=6, dtypes=(src.dtype,), device=src.device)
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_block_sums needs contiguous pools")
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"pools {tuple(src.shape)} and {tuple(dst.shape)} differ outside the "
                         "block dimension")
    if (src.shape[-1] * src.element_size()) % 4:
        raise ValueError(f"head_dim * itemsize must be a multiple of 4 bytes, pool {src.shape}")
    check_tensor("ids", ids, dim=2, dtypes=(torch.int64,), device=src.device)
    layers, kv = src.shape[:2]
    s3 = src.view(torch.int32).view(layers * kv, src.shape[2], -1)
    d3 = dst.view(torch.int32).view(layers * kv, dst.shape[2], -1)
    inner, n = s3.shape[2], ids.shape[1]
    check_tensor("out", out, dim=2, dtypes=(torch.int64,), device=src.device)
    if tuple(out.shape) != (n, 2):
        raise ValueError(f"out must be [{n}, 2], got {tuple(out.shape)}")
    chunks = cdiv(inner, CHUNK)
    grid = (n * chunks, layers * kv)
    strides = (s3.stride(0), s3.stride(1), d3.stride(0), d3.stride(1))

    def launch() -> torch.Tensor:
        if n:
            _block_sums_kernel[grid](s3, d3, ids, out, n, *strides, INNER=inner, CHUNKS=chunks,
                                     CHUNK=CHUNK, COPY=True, num_warps=4)
        return out

    return launch
