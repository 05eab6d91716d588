"""The plain-torch ops for paged attention and friends: the CPU execution path, and the
reference whose semantics every Triton kernel must match (the kernel tests compare the two).
Layout of one layer's cache: k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim].
A token at position p of a sequence lives in slot block_table[p // block_size] * block_size +
p % block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0           # largest finite e4m3fn value
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # floor of a dynamic scale (an all-zero row), as vLLM


def store_kv(key: torch.Tensor,          # [T, kv_heads, head_dim]
             value: torch.Tensor,        # [T, kv_heads, head_dim]
             k_cache: torch.Tensor,      # [num_blocks, block_size, kv_heads, head_dim]
             v_cache: torch.Tensor,      # [num_blocks, block_size, kv_heads, head_dim]
             slot_mapping: torch.Tensor  # [T] int64; negative slots are skipped (padding)
             ) -> None:
    nb, bs, kvh, d = k_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    for src, cache in ((key, k_cache), (value, v_cache)):
        if cache.dtype == FP8:  # saturated, stored through bytes (no fp8 index_copy_ on CPU)
            src, cache = to_fp8(src).view(torch.uint8), cache.view(torch.uint8)
        cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, src.to(cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, kv_heads, head_dim]."""
    nb, bs, kvh, d = cache.shape
    n_blocks = -(-length // bs)
    return cache[block_table[:n_blocks].long()].reshape(n_blocks * bs, kvh, d)[:length]


def paged_attention_decode(q: torch.Tensor,             # [B, heads, head_dim]
                           k_cache: torch.Tensor,       # [num_blocks, block_size, kv_heads, head_dim]
                           v_cache: torch.Tensor,
                           block_tables: torch.Tensor,  # [B, max_blocks] int32
                           seq_lens: torch.Tensor,      # [B] int32, context incl. the new token
                           scale: float,
                           ) -> torch.Tensor:           # [B, heads, head_dim]
    """One query token per sequence attending to its whole cached context (batched, masked)."""
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    max_len = int(seq_lens.max())
    n_blocks = -(-max_len // bs)
    table = block_tables[:, :n_blocks].long()
    pos = torch.arange(n_blocks * bs, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].to(pos.dtype)  # [B, L]
    # Slots past a sequence's end hold whatever the pool held (possibly NaN): zero them in the
    # gathered copies, since a zero attention weight times NaN is still NaN.
    # An fp8 cache is read in q's dtype (its scale is 1.0: the cast is the dequantization).
    k = k_cache[table].to(q.dtype).reshape(b, n_blocks * bs, kvh, d)
    v = v_cache[table].to(q.dtype).reshape(b, n_blocks * bs, kvh, d)
    k.masked_fill_(~valid[:, :, None, None], 0)
    v.masked_fill_(~valid[:, :, None, None], 0)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kvh, L, d]
    mask = valid[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
        enable_gqa=(h != kvh))
    return out.squeeze(2)


def paged_attention_extend(q: torch.Tensor,                # [T, heads, head_dim]
                           k_cache: torch.Tensor,          # [num_blocks, block_size, kv_heads, head_dim]
                           v_cache: torch.Tensor,
                           block_tables: torch.Tensor,     # [B, max_blocks] int32
                           query_start_loc: torch.Tensor,  # [B + 1] int32, offsets into T
                           seq_lens: torch.Tensor,         # [B] int32, context incl. new tokens
                           scale: float,
                           ) -> torch.Tensor:              # [T, heads, head_dim]
    """New tokens attend causally to themselves and to their cached prefix.

    Sequence b's queries are q[query_start_loc[b]:query_start_loc[b+1]]; they are the last
    q_len tokens of its seq_lens[b] tokens, whose K/V are already in the cache.
    """
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, ctx in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        q_len = e - s
        if q_len == 0:
            continue
        # 4-D [1, heads, len, d] operands: on CPU only these reach the fused (flash) SDPA kernel.
        k = _gather(k_cache, block_tables[b], ctx).transpose(0, 1)[None].to(q.dtype)
        v = _gather(v_cache, block_tables[b], ctx).transpose(0, 1)[None].to(q.dtype)
        qb = q[s:e].transpose(0, 1)[None]  # [1, h, q_len, d]
        if q_len == ctx:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale,
                                               enable_gqa=(h != kvh))
        else:
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=(h != kvh))
        out[s:e] = o[0].transpose(0, 1)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual); with residual given, x + residual is normed and returned
    as the new residual (the fused add-norm of a pre-norm transformer block)."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # a new tensor
    if weight.dtype == x.dtype:
        return normed.to(x.dtype).mul_(weight), residual
    return (weight * normed).to(x.dtype), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * n] (gate, up) -> silu(gate) * up: [..., n]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def apply_rotary(q: torch.Tensor,          # [T, heads, head_dim]
                 k: torch.Tensor,          # [T, kv_heads, head_dim]
                 positions: torch.Tensor,  # [T] int64
                 cos_sin: torch.Tensor,    # [max_pos, head_dim] float32: cos half | sin half
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as in HF Llama/Qwen2."""
    cs = cos_sin[positions]
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.empty(xf.shape, dtype=xf.dtype, device=xf.device)
        torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)  # x1 cos - x2 sin
        torch.mul(x2, cos, out=out[..., half:]).add_(x1 * sin)  # x2 cos + x1 sin
        return out.to(x.dtype)

    return rot(q), rot(k)


def copy_blocks(src: torch.Tensor,        # [..., num_blocks_src, block_size, kv_heads, head_dim]
                dst: torch.Tensor,        # [..., num_blocks_dst, block_size, kv_heads, head_dim]
                src_ids: torch.Tensor,    # [n] int64
                dst_ids: torch.Tensor,    # [n] int64
                block_dim: int = -4) -> None:
    """dst[..., dst_ids[i], ...] = src[..., src_ids[i], ...] along the block dimension."""
    dst.index_copy_(block_dim % dst.dim(), dst_ids, src.index_select(block_dim % src.dim(), src_ids))


def linear(x: torch.Tensor,                   # [M, K]
           weight: torch.Tensor,              # [N, K]
           bias: torch.Tensor | None = None,  # [N]
           ) -> torch.Tensor:                 # [M, N], x's dtype
    """x @ weight.T + bias accumulated in float32 and rounded once to x's dtype: the semantics
    of kernels.skinny_gemm.skinny_linear (and of F.linear on CUDA)."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


# ---- FP8 (e4m3fn) quantization: weights per output channel, activations per token ----------

def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x saturated to +-FP8_MAX, then rounded to the nearest e4m3fn (the cast alone is not
    saturating on every torch version)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor,  # [M, K]
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] fp8, [M, 1] float32
    """One scale per row, amax / FP8_MAX (at least FP8_MIN_SCALE): q = x / scale in e4m3fn,
    so x ~= q * scale. Per output channel for a weight [N, K], per token for activations
    (vLLM's online fp8); the semantics of kernels.fp8_linear.quantize_per_token."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return to_fp8(x.float() / scale), scale


def dequantize_rows(q: torch.Tensor,      # [N, K] fp8
                    scale: torch.Tensor,  # [N] or [N, 1] float32
                    dtype: torch.dtype) -> torch.Tensor:  # [N, K]
    """q * scale in float32, rounded once to dtype."""
    return (q.float() * scale.view(-1, 1)).to(dtype)


def fp8_linear(x: torch.Tensor,                   # [M, K]
               qweight: torch.Tensor,             # [N, K] fp8
               weight_scale: torch.Tensor,        # [N] float32
               bias: torch.Tensor | None = None,  # [N]
               ) -> torch.Tensor:                 # [M, N], x's dtype
    """W8A8: x quantized per token, the product of the fp8 values accumulated in float32,
    scaled by both scales, bias added, rounded once: the semantics of torch._scaled_mm with
    row-wise scales (kernels.fp8_linear.fp8_linear)."""
    xq, xs = quantize_rows(x)
    out = F.linear(xq.float(), qweight.float()) * xs * weight_scale.view(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
