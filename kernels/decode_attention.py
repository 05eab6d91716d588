"""Paged decode attention: one query token per sequence, split-K over the context (flash-decoding).

Stage 1 runs one program per (kv head, sequence, split). It loads the query rows of all the query
heads that share the kv head (GQA), so each K/V tile is read from the pool once, and runs an
online softmax over its share of the context. With one split it writes the normalised output;
otherwise it leaves (max, sum, unnormalised acc) per split in a workspace, and the splits of each
(sequence, head) are merged in one of two ways (`DecodeConfig.fused_merge`):

    two launches: stage 2, one program per (sequence, query head), merges after stage 1 ends.
    fused:        each stage-1 program, once its partial is stored, takes a ticket (an atomic add
                  on the workspace's counter of its (sequence, kv head)); the program that draws
                  the last ticket, num_splits - 1, merges the splits of that kv head's query heads
                  and puts the counter back to 0 for the next launch (or graph replay).

The grid depends only on shapes and `num_splits`, never on the values of `seq_lens`, so a decode
step that calls this can be captured in a CUDA graph.

Context split of one sequence (tiles of BLOCK_N tokens, splits of whole tiles):

    seq_len = 11 tokens, BLOCK_N = 4, num_splits = 3  ->  tiles_per_split = cdiv(3, 3) = 1
    | split 0: 0..3 | split 1: 4..7 | split 2: 8..10 |
    seq_len = 3: split 0 holds 0..2 and splits 1, 2 are empty (max -inf, sum 0: weight 0).

Rows whose seq_len is 0 (batch padding) come out as zeros.

An fp8 pool under a 16-bit q is read as 16-bit pairs (DecodeConfig.fp8_pairs, the engine's way):
int16 tiles of [BLOCK_N, head_dim / 2] go to shared memory by cp.async as stored, leave it
through 16-bit ldmatrix (V's transposed, as a bf16 pool's) and are split in registers into the
even and odd halves of the head dimension, each widened to fp16 (one prmt and two
cvt.rn.f16x2.e4m3x2 for four bytes); QK^T and PV are two dots of half the depth each, and the
two halves of acc are interleaved once at the end. The byte-wise read it replaced (the fallback
for a float32 q or a head_dim not a power of two) widens K after ldmatrix and V before shared
memory (ldmatrix has no transposing 8-bit form on sm_90: fp8 V goes to the dot in single bytes,
LDS.U8, unless widened first, DecodeConfig.widen_v_first), which costs V an fp16 copy through
shared memory: 1258 instructions a thread a 128-token tile, 162 registers, 74 KB, 0.54-0.65 of
copy at batch 128-256 (H200, bench/RESULTS.md "tenth" and "twelfth session, issue 19"; Nsight
Compute: latency-bound, no warp eligible in 54% of the cycles). The pairs read: 734
instructions, 162 registers, 41 KB (sm_90, triton 3.6), 0.71-0.89 of copy at batch 128-256,
0.75 with the block table a tile ahead at T4's shape (batch 256, context 512..768) and 0.86-0.93
at context 4k with 128 registers (bench/RESULTS.md "thirteenth session, issue 19").

Tried and dropped on the byte-wise read (bench/RESULTS.md "eighth", "tenth", "twelfth session,
issue 19"): QK^T on fp8 tensor cores with K as stored (q split into e4m3 hi + lo; 5-17% slower);
the whole tiles without masks and V widened by inline asm (DecodeConfig.peel, asm_widen: 39% fewer
instructions, 194 registers, 3-8% slower); V stored transposed in each block (230 registers, no
faster); two kv heads a program (as fast at batch 256, 10% slower at batch 128 / 4k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, cdiv, check_tensor, multiprocessors, next_pow2
from kernels.kv_store import KV_DTYPES

LOG2E = 1.4426950408889634
WAVES = 4  # DecodeConfig.waves' default


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters of stage 1 (tuned on the H200, see bench/NOTES.md)."""
    block_n: int = 64      # tokens per K/V tile
    num_warps: int = 4
    num_stages: int = 3
    waves: int = WAVES     # default_num_splits aims at about this many programs per multiprocessor
    fused_merge: bool = False  # splits > 1: merge in stage 1 (last ticket) instead of a 2nd launch
    widen_v_first: bool = True  # an fp8 pool under a 16-bit q: V to fp16 before shared memory
    # Off by default: on the H200 (bench/RESULTS.md "tenth session, issue 19") these cut the
    # fp8 tile loop's instructions by 39% but raised its registers from 162 to 194 a thread
    # (3 programs a multiprocessor to 2) and ran 3-8% slower at batch 128-256.
    peel: bool = False     # whole tiles in a loop without masks, the partial last tile after it
    asm_widen: bool = False  # with peel, V first, compiled: V widened by inline asm, no select
    # An fp8 pool under a 16-bit q, head_dim a power of two: the pool read as int16 pairs of
    # e4m3, K and V through shared memory as stored and widened after it, the head dimension in
    # even and odd halves (two dots of half the depth each); V needs no fp16 copy through shared
    # memory, and widen_v_first, peel and asm_widen do not apply.
    fp8_pairs: bool = False
    prefetch_table: bool = False  # fp8_pairs: the block table a tile ahead (K/V buffers deeper)
    max_registers: int | None = None  # fp8_pairs, compiled: triton's maxnreg for stage 1

    @classmethod
    def for_batch(cls, batch: int, kv_heads: int, device: torch.device,
                  fp8: bool = False) -> DecodeConfig:
        """The launch parameters for a decode of `batch` sequences (H200, llama-3-8b shapes,
        bench/NOTES.md "the engine sweep"), by the programs batch * kv_heads make before
        splitting, against the multiprocessors:

            <= 1/2 of them: 32-token tiles (a short context has few 64-token tiles, so few of
                            its splits have work; batch 8, ctx 512: 10.9 against 11.4 us)
            >  1/8 of them: the fused merge, one launch fewer (batch 8: 12.4 -> 10.9 us, 16:
                            18.0 -> 16.2, 32: 26.8 -> 25.8); below that the split count is 32
                            and the one merging program reads too much (batch 1: 6.7 vs 7.4)

        An fp8 pool (fp8) is read as 16-bit pairs (fp8_pairs, where the launch allows it; the
        V settings below are for the launches it does not), with the block table a tile ahead
        where there is one split (prefetch_table: batch 256 at context 512..768 106 against 113
        us, 0.75 of copy against 0.71; 1k 0.84 against 0.79), else, on 128-token tiles, at
        most 128 registers a thread, 4 programs a multiprocessor where 3 left 2 splits of batch
        32 in 1.3 waves (1k: 0.53 against 0.46, 4k: 0.75 against 0.60; H200, bench/RESULTS.md
        "thirteenth session, issue 19"; not on 32-token tiles, unmeasured there, where the cap
        spills in the fused merge's loop). It takes 128-token tiles where a bf16 one takes 64:
        half the bytes a tile (bench/gpu_fp8.py --sweep, 2026-12-02, batch 32-256 at 1k-4k:
        0.41-0.56 of copy against 0.32-0.45 with 64; 64 was slower than 32 there; measured
        before fp8_pairs existed). Above 2 programs a multiprocessor the byte-wise read widens
        V before shared memory (widen_v_first; bench/RESULTS.md
        "eighth session, issue 19": batch 128-256 at 1k-4k 0.57-0.66 of copy against 0.51-0.56;
        at batch 32 the other way round, 0.41-0.55 against 0.38-0.51).
        """
        programs, sms = batch * kv_heads, _processor_count(device)
        wide = 128 if fp8 else 64
        one_split = programs >= WAVES * sms  # default_num_splits' choice, whatever the context
        few = 2 * programs <= sms
        return cls(block_n=32 if few else wide, fused_merge=8 * programs > sms,
                   widen_v_first=not fp8 or programs > 2 * sms, fp8_pairs=fp8,
                   prefetch_table=fp8 and one_split,
                   max_registers=128 if fp8 and not one_split and not few else None)


@dataclass(frozen=True, slots=True)
class DecodeWorkspace:
    """Scratch of the split-K path, allocated once (e.g. before CUDA-graph capture). It holds up
    to `num_splits` splits: a launch may use fewer. Launches that share it must not overlap (one
    stream), and it must outlive every CUDA graph that captured a launch using it.

    `tickets` must be all zero when a fused-merge launch starts: allocate() zeroes it, and every
    such launch leaves it zero again (the merging program resets its counter). Only its first
    kv_heads columns are used; it is sized by query heads, a bound that needs no kv-head count."""
    acc: torch.Tensor      # [max_batch, heads, num_splits, head_dim] float32, unnormalised output
    max: torch.Tensor      # [max_batch, heads, num_splits] float32, running max (log2 units)
    sum: torch.Tensor      # [max_batch, heads, num_splits] float32, running sum of exp2
    tickets: torch.Tensor  # [max_batch, heads] int32, [b, kvh]: splits of (b, kvh) finished

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, head_dim: int, num_splits: int,
                 device: torch.device | str) -> DecodeWorkspace:
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(max_batch, num_heads, num_splits, head_dim, **f32),
                   torch.empty(max_batch, num_heads, num_splits, **f32),
                   torch.empty(max_batch, num_heads, num_splits, **f32),
                   torch.zeros(max_batch, num_heads, dtype=torch.int32, device=device))

    @property
    def num_splits(self) -> int:
        return self.acc.shape[2]


@triton.jit
def _merge_splits(
    acc_ptr,               # [>=B, H, ws_splits, D] float32
    max_ptr, sum_ptr,      # [>=B, H, ws_splits] float32
    out_ptr,               # [B, H, D]
    b, head0,              # the sequence and the first of the GROUP query heads to merge
    num_splits, ws_splits,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_S: tl.constexpr,
):
    """out[b, head0:head0 + GROUP] from the splits' partials, CHUNK_S splits of every head at a
    time (an online softmax over the chunks). Empty splits (max -inf, sum 0) weigh 0; a row
    whose splits are all empty comes out as zeros. Loads bypass L1 (.cg): in the fused path the
    partials were written by other programs of the same launch."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = head0 + offs_g
    m_run = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_G], tl.float32)
    num = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        offs_s = s0 + tl.arange(0, CHUNK_S)
        gs_mask = g_mask[:, None] & (offs_s < num_splits)[None, :]
        part = (b * NUM_HEADS + heads)[:, None] * ws_splits + offs_s[None, :]  # [BLOCK_G, CHUNK_S]
        m = tl.load(max_ptr + part, mask=gs_mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(sum_ptr + part, mask=gs_mask, other=0.0, cache_modifier=".cg")
        acc = tl.load(acc_ptr + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                      mask=gs_mask[:, :, None] & d_mask[None, None, :], other=0.0,
                      cache_modifier=".cg")  # [BLOCK_G, CHUNK_S, BLOCK_D]
        m_new = tl.maximum(m_run, tl.max(m, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # every split so far empty
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(m - m_ref[:, None])  # 0 for empty splits
        l_run = l_run * alpha + tl.sum(l_s * w, 1)
        num = num * alpha[:, None] + tl.sum(acc * w[:, :, None], 1)
        m_run = m_new
    o = num / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _e4m3_to_f16(x, pin):
    """e4m3 -> fp16, four elements a register, through cvt.rn.f16x2.e4m3x2 (the conversion
    triton's own cast uses). `pin`, an unused int8 operand of x's shape, makes it an op of two
    operands, which triton does not move past the layout change into the dot's operand: V is
    widened before shared memory, as the select of the masked tile does, without the select
    (sm_90 SASS of the whole-tile loop: no SEL or PRMT left, 728 instructions a thread a
    128-token tile against 1192; triton 3.9 offline)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
        "cvt.rn.f16x2.e4m3x2 $1, hi; }", "=r,=r,r,r", [x, pin], dtype=tl.float16,
        is_pure=True, pack=4)


@triton.jit
def _e4m3_pairs_to_f16(x, ASM: tl.constexpr):
    """int16 elements that each hold two e4m3 bytes (an fp8 pool read as 16-bit pairs) -> (the
    low bytes, the high bytes) widened to fp16. ASM (compiled): one prmt and two
    cvt.rn.f16x2.e4m3x2 for the two pairs of a register; the interpreter runs no asm."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 a, b; prmt.b32 t, $2, 0, 0x3120; mov.b32 {a, b}, t; "
            "cvt.rn.f16x2.e4m3x2 $0, a; cvt.rn.f16x2.e4m3x2 $1, b; }",
            "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        lo = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = ((x >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return lo, hi


@triton.jit
def _attend_pairs(
    q_row,                 # q_ptr + b * stride_qb
    heads, g_mask,         # [BLOCK_G] the program's query heads, and which of them are real
    start, end,            # the split's tokens
    k_ptr, v_ptr,          # the fp8 pools viewed as int16: [num_blocks, BLOCK_SIZE, KVH, D / 2]
    table, kvh, qk_scale,
    stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SAME_KV_STRIDES: tl.constexpr, ASM: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The split's online softmax on an fp8 pool read as 16-bit pairs (DecodeConfig.fp8_pairs):
    the head dimension in its even and odd halves, each a dot of half the depth. K and V reach
    shared memory as stored (cp.async) and leave it through 16-bit ldmatrix (V transposed, as a
    16-bit pool's), each pair's two bytes widened in registers; V needs no fp16 copy through
    shared memory. PREFETCH: the block table a tile ahead, so that triton's pipeliner gives K
    and V num_stages - 1 buffers (without it, one: their addresses hang on the table's load of
    the same tile). Returns (m, l, acc), acc's columns in order (even and odd interleaved)."""
    HALF_D: tl.constexpr = BLOCK_D // 2
    offs_c = tl.arange(0, HALF_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_ptrs = q_row + heads[:, None] * stride_qh + 2 * offs_c[None, :]
    q_lo = tl.load(q_ptrs, mask=g_mask[:, None], other=0.0).to(tl.float16)  # [BLOCK_G, HALF_D]
    q_hi = tl.load(q_ptrs + 1, mask=g_mask[:, None], other=0.0).to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_lo = tl.zeros([BLOCK_G, HALF_D], tl.float32)
    acc_hi = tl.zeros([BLOCK_G, HALF_D], tl.float32)
    if PREFETCH:
        nxt = tl.load(table + (start + offs_n) // BLOCK_SIZE, mask=start + offs_n < end, other=0)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        n_mask = pos < end
        if PREFETCH:  # the next tile's blocks now: K and V hang on no load of this tile
            block = nxt.to(tl.int64)
            nxt = tl.load(table + (pos + BLOCK_N) // BLOCK_SIZE, mask=pos + BLOCK_N < end,
                          other=0)
        else:
            block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = (pos % BLOCK_SIZE).to(tl.int64)
        k_row = block * stride_kb + row * stride_kt + kvh * stride_kh
        v_row = k_row if SAME_KV_STRIDES else block * stride_vb + row * stride_vt + kvh * stride_vh
        k = tl.load(k_ptr + k_row[:, None] + offs_c[None, :], mask=n_mask[:, None], other=0)
        v = tl.load(v_ptr + v_row[:, None] + offs_c[None, :], mask=n_mask[:, None], other=0)
        k_lo, k_hi = _e4m3_pairs_to_f16(k, ASM)  # [BLOCK_N, HALF_D] each
        s = tl.dot(q_lo, tl.trans(k_lo))
        s = tl.dot(q_hi, tl.trans(k_hi), s) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_lo, v_hi = _e4m3_pairs_to_f16(v, ASM)
        p = p.to(tl.float16)
        acc_lo = tl.dot(p, v_lo, acc_lo * alpha[:, None])
        acc_hi = tl.dot(p, v_hi, acc_hi * alpha[:, None])
        m_i = m_new
    return m_i, l_i, tl.reshape(tl.join(acc_lo, acc_hi), [BLOCK_G, BLOCK_D])


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc,      # [BLOCK_G, BLOCK_D] q; the online softmax's running max, sum, acc
    tile, end,             # the tile's first token; the split's end (masked tiles only)
    k_ptr, v_ptr, table, kvh, qk_scale,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_V_FIRST: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr, ASM_WIDEN: tl.constexpr, MASKED: tl.constexpr,
):
    """One BLOCK_N-token tile of the online softmax. MASKED: tokens at or past `end` count for
    nothing; otherwise the tile is whole and its loads (when HEAD_DIM == BLOCK_D) and scores
    carry no mask."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    pos = tile + offs_n
    n_mask = pos < end
    if MASKED:
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        block = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
    row = (pos % BLOCK_SIZE).to(tl.int64)
    k_row = block * stride_kb + row * stride_kt + kvh * stride_kh
    # K and V pools of the same strides (the engine's): one address computation for both
    v_row = k_row if SAME_KV_STRIDES else block * stride_vb + row * stride_vt + kvh * stride_vh
    k_ptrs = k_ptr + k_row[:, None] + offs_d[None, :]
    v_ptrs = v_ptr + v_row[:, None] + offs_d[None, :]
    kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    if MASKED or HEAD_DIM != BLOCK_D:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if WIDEN_V_FIRST:
        # V to fp16 before shared memory: fp16 V reaches the dot through ldmatrix.trans, where
        # fp8 V goes in single bytes (LDS.U8: no transposing 8-bit ldmatrix on sm_90), at the
        # cost of an fp16 copy of V through shared memory. Triton would move a plain cast past
        # the copy: the inline conversion (whole tiles, compiled) or a select stops it.
        if ASM_WIDEN:
            v = _e4m3_to_f16(v, tl.full(v.shape, 0, tl.int8) + end.to(tl.int8))
        else:
            v = tl.where(kv_mask, v.to(tl.float16), 0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(n_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                        input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_split(
    q_row, heads, g_mask, d_mask, start, end, k_ptr, v_ptr, table, kvh, qk_scale,
    stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    F16_DOT: tl.constexpr, WIDEN_V_FIRST: tl.constexpr, PEEL: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr, ASM_WIDEN: tl.constexpr,
):
    """The split's online softmax, a BLOCK_N-token tile at a time: returns (m, l, acc)."""
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_row + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if F16_DOT:  # an fp8 pool: its tiles widen to fp16 directly (to bf16 through float32)
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if PEEL:  # the whole tiles without masks, then the split's last, partial tile
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for tile in range(start, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, end, k_ptr, v_ptr, table, kvh, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, WIDEN_V_FIRST,
                SAME_KV_STRIDES, ASM_WIDEN, False)
        if full_end < end:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, full_end, end, k_ptr, v_ptr, table, kvh, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, WIDEN_V_FIRST,
                SAME_KV_STRIDES, False, True)
    else:
        for tile in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, end, k_ptr, v_ptr, table, kvh, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, WIDEN_V_FIRST,
                SAME_KV_STRIDES, False, True)
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,                 # [B, H, D]
    k_ptr, v_ptr,          # [num_blocks, BLOCK_SIZE, KVH, D]
    tables_ptr,            # [B, max_blocks] int32
    seq_lens_ptr,          # [B] int32
    out_ptr,               # [B, H, D], written when SINGLE_SPLIT or FUSED_MERGE
    acc_ptr,               # [>=B, H, ws_splits, D] float32, written unless SINGLE_SPLIT
    max_ptr, sum_ptr,      # [>=B, H, ws_splits] float32
    tickets_ptr,           # [>=B, H] int32, zero at launch; used when FUSED_MERGE
    qk_scale,              # softmax scale * log2(e)
    num_splits, ws_splits,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, F16_DOT: tl.constexpr,
    FUSED_MERGE: tl.constexpr, MERGE_G: tl.constexpr, CHUNK_S: tl.constexpr,
    WIDEN_V_FIRST: tl.constexpr = False, PEEL: tl.constexpr = False,
    SAME_KV_STRIDES: tl.constexpr = False, ASM_WIDEN: tl.constexpr = False,
    PAIRS: tl.constexpr = False, COMPILED: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    # kv heads fastest: the heads of one sequence run side by side, reading the adjacent
    # 256-byte rows of the same blocks (H200, batch 256 at context 640: 1% faster than the other
    # way round).
    kvh = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    table = tables_ptr + b * stride_tb
    if PAIRS:  # k_ptr, v_ptr: the fp8 pools as int16, strides in int16
        m_i, l_i, acc = _attend_pairs(
            q_ptr + b * stride_qb, heads, g_mask, start, end, k_ptr, v_ptr, table, kvh,
            qk_scale, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
            stride_vh, BLOCK_G, BLOCK_D, BLOCK_SIZE, BLOCK_N, SAME_KV_STRIDES, COMPILED,
            PREFETCH)
    else:
        m_i, l_i, acc = _attend_split(
            q_ptr + b * stride_qb, heads, g_mask, d_mask, start, end, k_ptr, v_ptr, table, kvh,
            qk_scale, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
            stride_vh, BLOCK_G, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, F16_DOT,
            WIDEN_V_FIRST, PEEL, SAME_KV_STRIDES, ASM_WIDEN)

    if SINGLE_SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        part = (b * NUM_HEADS + heads) * ws_splits + split  # [BLOCK_G]
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(max_ptr + part, m_i, mask=g_mask)
        tl.store(sum_ptr + part, l_i, mask=g_mask)
        if FUSED_MERGE:
            # Release: the barrier puts every thread's partial stores before the atomic, which
            # one thread performs. Acquire: the program drawing the last ticket reads the other
            # splits' partials only after its atomic (its result reaches the other threads
            # through a barrier) and from L2 (.cg loads in _merge_splits).
            counter = tickets_ptr + b * NUM_HEADS + kvh
            tl.debug_barrier()
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                _merge_splits(acc_ptr, max_ptr, sum_ptr, out_ptr, b, kvh * GROUP, num_splits,
                              ws_splits, stride_ob, stride_oh, NUM_HEADS, GROUP, MERGE_G,
                              HEAD_DIM, BLOCK_D, CHUNK_S)
                tl.store(counter, 0)  # every split has drawn its ticket: ready for the next launch


@triton.jit
def _decode_merge_kernel(
    acc_ptr,               # [>=B, H, ws_splits, D] float32
    max_ptr, sum_ptr,      # [>=B, H, ws_splits] float32
    out_ptr,               # [B, H, D]
    num_splits, ws_splits,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK_S: tl.constexpr,
):
    _merge_splits(acc_ptr, max_ptr, sum_ptr, out_ptr, tl.program_id(0).to(tl.int64),
                  tl.program_id(1), num_splits, ws_splits, stride_ob, stride_oh, NUM_HEADS, 1, 1,
                  HEAD_DIM, BLOCK_D, CHUNK_S)


def _merge_chunk(heads: int, block_d: int, num_warps: int, regs: int) -> int:
    """Splits merged per step (a power of two): the [heads, splits, head_dim] float32 tile takes
    about `regs` registers a thread. The merge kernel takes 64 and at most the split count: one
    load for up to 64 splits of head_dim 128, as before the fused merge existed. The fused merge
    takes 32, whatever the split count: triton 3.6 on sm_90 at llama-3-8b shapes then keeps
    stage 1 at 114 registers (112 without the merge), where 64 gave 146, and tiles of 2 or 4
    splits 136-138 (one program fewer per multiprocessor)."""
    fit = max(1, regs * 32 * num_warps // (heads * block_d))
    return 1 << (fit.bit_length() - 1)


def _processor_count(device: torch.device) -> int:
    # The interpreter: 4, few programs but still more than one split on small tests.
    return multiprocessors(device) or 4


def default_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device,
                       config: DecodeConfig) -> int:
    """Splits so that batch * kv_heads * splits programs fill the GPU up to `config.waves` times
    over, with at least two tiles per split, rounded down to a power of two (on the H200, 3
    splits of 32 x 8 programs ran 15% slower than 2). Uses shapes only (no device sync), so
    `max_context` is the table capacity, an upper bound on seq_lens."""
    want = cdiv(config.waves * _processor_count(device), batch * kv_heads)
    most = max(1, max_context // (2 * config.block_n))
    return 1 << (min(want, most, 128).bit_length() - 1)


def paged_attention_decode(
    q: torch.Tensor,             # [B, heads, head_dim]
    k_cache: torch.Tensor,       # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,       # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,      # [B] int32, context incl. the new token
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [B, heads, head_dim], q's dtype
    num_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:               # [B, heads, head_dim]
    """Same result as torch_ops.paged_attention_decode. For CUDA graphs pass `out`, a
    `workspace` allocated beforehand and a fixed `num_splits` (the workspace's by default, at
    most its capacity). Without a workspace, a split launch allocates one (with fused_merge
    that includes zeroing its tickets: one more device op). `config`: DecodeConfig.for_batch
    by default."""
    dev = q.device
    check_tensor("q", q, dim=3, dtypes=FLOAT_DTYPES)
    b, h, d = q.shape
    check_tensor("k_cache", k_cache, dim=4, dtypes=KV_DTYPES, device=dev)
    _, block_size, kvh, _ = k_cache.shape
    check_tensor("k_cache", k_cache, shape=(None, None, None, d))
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,),
                 device=dev)
    check_tensor("block_tables", block_tables, dim=2, dtypes=(torch.int32,), device=dev)
    check_tensor("block_tables", block_tables, shape=(b, None))
    check_tensor("seq_lens", seq_lens, shape=(b,), dtypes=(torch.int32,), device=dev)
    if h % kvh:
        raise ValueError(f"q has {h} heads, not a multiple of the cache's {kvh} kv heads")
    if d < 16:
        raise ValueError(f"head_dim {d} < 16 is not supported by tl.dot")
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, shape=(b, h, d), dtypes=(q.dtype,), device=dev)
    config = config or DecodeConfig.for_batch(b, kvh, dev, k_cache.dtype == torch.float8_e4m3fn)
    if num_splits is None:
        num_splits = (workspace.num_splits if workspace is not None else default_num_splits(
            b, kvh, block_tables.shape[1] * block_size, dev, config))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if b == 0:
        return out
    if num_splits > 1:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(b, h, d, num_splits, dev)
        _check_workspace(workspace, b, h, d, num_splits, dev)
        ws = workspace
    else:
        ws = None  # the single-split kernel writes `out` only

    group = h // kvh
    block_d = next_pow2(d)
    fused = config.fused_merge
    f16_dot = k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32
    pairs = config.fp8_pairs and f16_dot and d == block_d
    if pairs:  # the pools as 16-bit pairs of e4m3 (their strides halve)
        k_cache, v_cache = k_cache.view(torch.int16), v_cache.view(torch.int16)
    compiled = dev.type == "cuda"  # the interpreter runs no inline asm
    extra = {"maxnreg": config.max_registers} if config.max_registers and compiled and pairs \
        else {}
    _decode_split_kernel[(kvh, b, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out,
        *((ws.acc, ws.max, ws.sum, ws.tickets) if ws is not None else (out,) * 4),
        scale * LOG2E, num_splits, ws.num_splits if ws is not None else 1,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=h, GROUP=group, BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=config.block_n, SINGLE_SPLIT=num_splits == 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        F16_DOT=f16_dot, WIDEN_V_FIRST=f16_dot and config.widen_v_first, PEEL=config.peel,
        SAME_KV_STRIDES=k_cache.stride() == v_cache.stride(),
        ASM_WIDEN=config.asm_widen and compiled, PAIRS=pairs, COMPILED=compiled,
        PREFETCH=pairs and config.prefetch_table,
        FUSED_MERGE=fused, MERGE_G=next_pow2(group),
        CHUNK_S=_merge_chunk(next_pow2(group), block_d, config.num_warps, 32),
        num_warps=config.num_warps, num_stages=config.num_stages, **extra,
    )
    if ws is not None and not fused:
        merge_warps = 4 if d >= 128 else 2
        _decode_merge_kernel[(b, h)](
            ws.acc, ws.max, ws.sum, out, num_splits, ws.num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=h, HEAD_DIM=d, BLOCK_D=block_d,
            CHUNK_S=min(next_pow2(num_splits), _merge_chunk(1, block_d, merge_warps, 64)),
            num_warps=merge_warps,
        )
    return out


def _check_workspace(ws: DecodeWorkspace, b: int, h: int, d: int, num_splits: int,
                     dev: torch.device) -> None:
    cap, heads, splits, dim = ws.acc.shape
    fits = (cap >= b and heads == h and splits >= num_splits and dim == d and ws.acc.device == dev
            and ws.max.shape == ws.sum.shape == (cap, h, splits)
            and ws.tickets.shape == (cap, h) and ws.tickets.dtype == torch.int32
            and all(t.is_contiguous() and t.device == dev
                    for t in (ws.acc, ws.max, ws.sum, ws.tickets)))
    if not fits:
        raise ValueError(f"workspace {tuple(ws.acc.shape)} on {ws.acc.device} does not fit batch "
                         f"{b}, {h} heads, {num_splits} splits, head_dim {d} on {dev}")
