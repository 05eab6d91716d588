"""Write new tokens' K/V into the paged pool by slot mapping, optionally applying rotary first.

Slot s is row s % block_size of block s // block_size; negative slots (padding) are skipped.
`rotary_store_kv` fuses torch_ops.apply_rotary (neox rotate-half; the cos/sin cache is already
scaled, e.g. llama3) with the store: it rotates k on its way into the cache and writes the rotated
q, so the new K is never materialised unrotated-then-rotated in device memory. One program per
token handles all of its heads.

An fp8 pool (torch.float8_e4m3fn, --kv-cache-dtype fp8) has one scale per tensor, 1.0 (vLLM's
default when a checkpoint carries none): a value is stored saturated to +-448 and rounded to
e4m3 (`cache_value`, kernels.torch_ops.to_fp8), and read back by a plain cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, check_tensor, next_pow2

KV_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)   # what a KV pool may hold


@triton.jit
def cache_value(x, ty: tl.constexpr):
    """x as the pool stores it: rounded to ty, saturated first when ty is e4m3."""
    if ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(ty)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,    # [T, KVH, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    slots_ptr,             # [T] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    row = tl.maximum(slot, 0) % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    hd = offs_h[:, None]
    k = tl.load(key_ptr + t * stride_kt + hd * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + hd * stride_vh + offs_d[None, :], mask=mask)
    store = mask & ((hd * 0 + slot) >= 0)  # [BLOCK_H, 1] broadcast of the scalar test
    tl.store(k_cache_ptr + block * stride_kcb + row * stride_kct + hd * stride_kch
             + offs_d[None, :], cache_value(k, k_cache_ptr.dtype.element_ty), mask=store)
    tl.store(v_cache_ptr + block * stride_vcb + row * stride_vct + hd * stride_vch
             + offs_d[None, :], cache_value(v, v_cache_ptr.dtype.element_ty), mask=store)


@triton.jit
def _rotate_half(x1, x2, cos, sin, out_ty: tl.constexpr):
    """Neox rotary on the two halves (float32 math, rounded to the input dtype as the
    reference does)."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return (x1 * cos - x2 * sin).to(out_ty), (x2 * cos + x1 * sin).to(out_ty)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr,                 # [T, H, D]
    key_ptr, value_ptr,    # [T, KVH, D]
    q_out_ptr,             # [T, H, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    positions_ptr,         # [T] int64
    cos_sin_ptr,           # [max_pos, D] float32: cos half | sin half
    slots_ptr,             # [T] int64
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_cs,
    HEADS: tl.constexpr, BLOCK_HQ: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    offs_c = tl.arange(0, BLOCK_HALF)
    c_mask = offs_c < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_c, mask=c_mask)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_c, mask=c_mask)[None, :]
    lo = offs_c[None, :]

    qh = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = (qh < HEADS) & c_mask[None, :]
    q_row = q_ptr + t * stride_qt + qh * stride_qh
    q1, q2 = _rotate_half(tl.load(q_row + lo, mask=q_mask), tl.load(q_row + HALF + lo, mask=q_mask),
                          cos, sin, q_out_ptr.dtype.element_ty)
    o_row = q_out_ptr + t * stride_ot + qh * stride_oh
    tl.store(o_row + lo, q1, mask=q_mask)
    tl.store(o_row + HALF + lo, q2, mask=q_mask)

    slot = tl.load(slots_ptr + t)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    row = tl.maximum(slot, 0) % BLOCK_SIZE
    kh = tl.arange(0, BLOCK_H)[:, None]
    k_mask = (kh < KV_HEADS) & c_mask[None, :]
    k_row = key_ptr + t * stride_kt + kh * stride_kh
    k1, k2 = _rotate_half(tl.load(k_row + lo, mask=k_mask), tl.load(k_row + HALF + lo, mask=k_mask),
                          cos, sin, key_ptr.dtype.element_ty)
    store = k_mask & ((kh * 0 + slot) >= 0)
    kc_row = k_cache_ptr + block * stride_kcb + row * stride_kct + kh * stride_kch
    tl.store(kc_row + lo, cache_value(k1, k_cache_ptr.dtype.element_ty), mask=store)
    tl.store(kc_row + HALF + lo, cache_value(k2, k_cache_ptr.dtype.element_ty), mask=store)
    v_row = value_ptr + t * stride_vt + kh * stride_vh
    vc_row = v_cache_ptr + block * stride_vcb + row * stride_vct + kh * stride_vch
    for half in tl.static_range(2):
        v = tl.load(v_row + half * HALF + lo, mask=k_mask)
        tl.store(vc_row + half * HALF + lo, cache_value(v, v_cache_ptr.dtype.element_ty),
                 mask=store)


def _check_store_args(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    dev = key.device
    check_tensor("key", key, dim=3, dtypes=FLOAT_DTYPES)
    t, kvh, d = key.shape
    check_tensor("value", value, shape=(t, kvh, d), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("k_cache", k_cache, shape=(None, None, kvh, d), dtypes=KV_DTYPES, device=dev)
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=KV_DTYPES, device=dev)
    check_tensor("slot_mapping", slot_mapping, shape=(t,), dtypes=(torch.int64,), device=dev)


def store_kv(key: torch.Tensor,          # [T, kv_heads, head_dim]
             value: torch.Tensor,        # [T, kv_heads, head_dim]
             k_cache: torch.Tensor,      # [num_blocks, block_size, kv_heads, head_dim]
             v_cache: torch.Tensor,      # [num_blocks, block_size, kv_heads, head_dim]
             slot_mapping: torch.Tensor  # [T] int64; negative slots are skipped (padding)
             ) -> None:
    """Same effect as torch_ops.store_kv. Slots must be < num_blocks * block_size."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    t, kvh, d = key.shape
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KV_HEADS=kvh, BLOCK_H=next_pow2(kvh), HEAD_DIM=d, BLOCK_D=next_pow2(d),
        BLOCK_SIZE=k_cache.shape[1], num_warps=4,
    )


def rotary_store_kv(q: torch.Tensor,             # [T, heads, head_dim]
                    key: torch.Tensor,           # [T, kv_heads, head_dim], not yet rotated
                    value: torch.Tensor,         # [T, kv_heads, head_dim]
                    positions: torch.Tensor,     # [T] int64
                    cos_sin: torch.Tensor,       # [max_pos, head_dim] float32: cos | sin
                    k_cache: torch.Tensor,       # [num_blocks, block_size, kv_heads, head_dim]
                    v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor,  # [T] int64; negative slots are skipped
                    *,
                    q_out: torch.Tensor | None = None,  # [T, heads, head_dim]; may be q itself
                    ) -> torch.Tensor:           # rotated q: [T, heads, head_dim]
    """torch_ops.apply_rotary(q, key) then torch_ops.store_kv(rotated key, value), in one pass.
    Returns the rotated q (all rows, padding included); the rotated key only goes to the cache."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    dev = key.device
    t, kvh, d = key.shape
    check_tensor("q", q, shape=(t, None, d), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("positions", positions, shape=(t,), dtypes=(torch.int64,), device=dev)
    check_tensor("cos_sin", cos_sin, shape=(None, d), dtypes=(torch.float32,), device=dev)
    if d % 2:
        raise ValueError(f"rotary needs an even head_dim, got {d}")
    if q_out is None:
        q_out = torch.empty_like(q)
    check_tensor("q_out", q_out, shape=tuple(q.shape), dtypes=(q.dtype,), device=dev)
    if t == 0:
        return q_out
    h = q.shape[1]
    _rotary_store_kv_kernel[(t,)](
        q, key, value, q_out, k_cache, v_cache, positions, cos_sin, slot_mapping,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos_sin.stride(0),
        HEADS=h, BLOCK_HQ=next_pow2(h), KV_HEADS=kvh, BLOCK_H=next_pow2(kvh),
        HALF=d // 2, BLOCK_HALF=next_pow2(d // 2), BLOCK_SIZE=k_cache.shape[1], num_warps=4,
    )
    return q_out
