"""Row-wise argmax over a vocabulary, torch.argmax(x, dim=-1)'s result, in two short launches.

torch's reduction gives one row to few thread blocks, so a single 128k-entry row (batch-1 greedy
decoding) is a latency-bound 27 us on the H200, longer than the lm_head GEMV's own tail. Here the
row is cut into chunks that run side by side:

    stage 1, program (row, chunk):  best (value, index) of x[row, chunk * BLOCK : ...]
    stage 2, program (row):         the best of the row's chunks -> out[row]

Ties go to the lowest index, as in torch: within a chunk tl.argmax breaks ties to the left, and
stage 2 keeps the leftmost of equal chunks. NaN counts as the largest value (torch's rule), so a
row with a NaN returns the index of its first NaN; a row of -inf returns 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, cdiv, check_tensor, next_pow2

BLOCK = 4096  # entries per stage-1 program: 32 programs for a 128k row


@triton.jit
def _argmax_chunk_kernel(
    x_ptr,                 # [rows, V]
    val_ptr,               # [rows, CHUNKS] float32: the chunk's best value (NaN when it has one)
    idx_ptr,               # [rows, CHUNKS] int64: its index in the row
    V, stride_x,
    CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    value, pick = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    if tl.max(is_nan.to(tl.int32), 0) > 0:   # rare: the first NaN, reported as NaN
        pick = tl.argmax(is_nan.to(tl.int32), 0, tie_break_left=True)
        value = tl.full([], float("nan"), tl.float32)
    tl.store(val_ptr + row * CHUNKS + chunk, value)
    tl.store(idx_ptr + row * CHUNKS + chunk, (chunk * BLOCK + pick).to(tl.int64))


@triton.jit
def _argmax_rows_kernel(
    val_ptr, idx_ptr,      # [rows, CHUNKS] from stage 1
    out_ptr,               # [rows] int64
    CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < CHUNKS
    v = tl.load(val_ptr + row * CHUNKS + offs, mask=mask, other=float("-inf"))
    is_nan = (v != v) & mask
    any_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    j = tl.where(any_nan, tl.argmax(is_nan.to(tl.int32), 0, tie_break_left=True),
                 tl.argmax(tl.where(is_nan, float("-inf"), v), 0, tie_break_left=True))
    tl.store(out_ptr + row, tl.load(idx_ptr + row * CHUNKS + j))


def argmax_rows(x: torch.Tensor,  # [rows, V] float, last dimension contiguous
                ) -> torch.Tensor:  # [rows] int64 on x's device
    """torch.argmax(x, dim=-1) for a 2-D float tensor (see the module docstring)."""
    check_tensor("x", x, dim=2, dtypes=FLOAT_DTYPES)
    rows, vocab = x.shape
    if vocab == 0:
        raise ValueError("argmax_rows: the rows are empty")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    block = min(BLOCK, next_pow2(vocab))
    chunks = cdiv(vocab, block)
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idxs = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    _argmax_chunk_kernel[(rows, chunks)](x, vals, idxs, vocab, x.stride(0), CHUNKS=chunks,
                                         BLOCK=block, num_warps=8 if block >= 2048 else 4)
    _argmax_rows_kernel[(rows,)](vals, idxs, out, CHUNKS=chunks,
                                 BLOCK_C=max(2, next_pow2(chunks)), num_warps=1)
    return out
