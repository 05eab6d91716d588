"""FP8 (e4m3fn) in the kernels: per-token quantization, the W8A8 GEMM (torch._scaled_mm, GPU
only), the batch-1 GEMVs reading fp8 weights with their row scales, and the K/V store and the
attention kernels on an fp8 pool, each against kernels.torch_ops (the CPU path)."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_linear, kv_store, norm_act, torch_ops
from kernels.decode_attention import DecodeConfig, paged_attention_decode
from kernels.extend_attention import paged_attention_extend
from kernels.fused_gemv import act_linear, norm_linear
from kernels.fused_qkv import norm_qkv_rotary_store
from kernels.skinny_gemm import SkinnyConfig, skinny_linear

F32, BF16, FP8 = torch.float32, torch.bfloat16, torch.float8_e4m3fn
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
EPS = 1e-5
# One e4m3 step is 2^-3 of the value's power of two: rounding moves a value by at most half
# of that, 1/16 relative.
E4M3_STEP = 2.0 ** -3


def _assert_fp8_close(got: torch.Tensor, want: torch.Tensor, device: str,
                      atol: float = 2.0 ** -9) -> None:
    """got within one e4m3 step of want. On the CPU the Triton interpreter (3.x) converts to
    e4m3 without carrying a mantissa that rounds up into the exponent: 1.9375 comes out 1.0, so
    a value whose nearest e4m3 is a power of two 2^e may come out 2^(e-1); that case alone is
    accepted there (the GPU tests hold the compiled conversion to exactness)."""
    g, w = got.float(), want.float()
    ok = (g - w).abs() <= w.abs() * E4M3_STEP + atol
    if device == "cpu":
        ok |= (g * 2 == w) & (torch.frexp(w).mantissa.abs() == 0.5)
    assert ok.all(), f"{(~ok).sum().item()} values off: {g[~ok][:4]} vs {w[~ok][:4]}"


def _fp8_weight(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = torch_ops.quantize_rows(torch.randn(n, k, device=device) * k ** -0.5)
    return q, scale.view(-1)


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_mm_triton(device: str, check_rel) -> None:
    """fp8_linear.scaled_mm_triton = the float32 product of the same fp8 values times both
    scales (plus bias): M not a multiple of the row tile, N not of the column tile, row tiles
    grouped; on the GPU also T4's M = 256 on o's and down's shapes."""
    small = fp8_linear.GemmConfig(block_m=16, block_n=32, block_k=32, group_m=2)
    shapes = [(37, 80, 96, small)] if device == "cpu" else [
        (37, 80, 256, None), (256, 4096, 4096, None), (256, 4096, 14336, None),
        (1000, 6144, 4096, fp8_linear.GemmConfig(block_m=128, block_n=128))]
    for m, n, k, cfg in shapes:
        q, scale = _fp8_weight(n, k, device)
        x = torch.randn(m, k, device=device) * torch.logspace(-2, 2, m, device=device)[:, None]
        xq, xs = torch_ops.quantize_rows(x)
        bias = torch.randn(n, device=device).to(BF16)
        out = fp8_linear.scaled_mm_triton(xq, xs, q, scale, bias, BF16, cfg)
        assert out.shape == (m, n) and out.dtype == BF16
        want = (xq.float() @ q.float().t()) * xs * scale[None, :] + bias.float()
        check_rel(out.float(), want, 6e-3)


def test_quantize_rows_reference() -> None:
    """Scale = amax / 448 per row; dequantized values within half an e4m3 step; saturation
    instead of NaN; an all-zero row keeps a positive scale."""
    x = torch.randn(8, 256) * torch.logspace(-3, 3, 8)[:, None]
    x[3] = 0.0
    q, scale = torch_ops.quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (8, 1) and scale.dtype == F32
    amax = x.abs().amax(1, keepdim=True)
    assert torch.equal(scale[amax > 0], (amax / 448.0)[amax > 0])
    assert scale[3].item() == pytest.approx(torch_ops.FP8_MIN_SCALE, rel=1e-6)
    assert not q.float().isnan().any()
    back = q.float() * scale
    assert torch.equal(back.abs().amax(1), amax.view(-1))   # the row's amax maps to 448 exactly
    assert ((back - x).abs() <= x.abs() * E4M3_STEP / 2 + scale * 2.0 ** -9).all()
    assert torch.equal(torch_ops.to_fp8(torch.tensor([1e4, -1e4])).float(),
                       torch.tensor([448.0, -448.0]))


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_per_token(device: str) -> None:
    m, k = (5, 96) if device == "cpu" else (300, 4096)
    x = (torch.randn(m, k, device=device) * 4).to(BF16)
    x[1] = 0
    q, scale = fp8_linear.quantize_per_token(x)
    want_q, want_scale = torch_ops.quantize_rows(x)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    if device == "cuda":
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    else:
        _assert_fp8_close(q, want_q, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [2, 17, 256, 1000])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("fast_accum", [True, False])
def test_scaled_mm_linear(m: int, n: int, k: int, fast_accum: bool, check_rel) -> None:
    """torch._scaled_mm with row-wise scales = the float32 product of the same fp8 values
    (only the summation order, the accumulators' precision and the bf16 output rounding
    differ), with the tensor cores' accumulation over all of K (fast_accum) or promoted."""
    q, scale = _fp8_weight(n, k, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    bias = torch.randn(n, device="cuda", dtype=BF16)
    assert fp8_linear.supports(x, q)
    out = fp8_linear.fp8_linear(x, q, scale, bias, fast_accum=fast_accum)
    assert out.shape == (m, n) and out.dtype == BF16
    check_rel(out.float(), torch_ops.fp8_linear(x.float(), q, scale, bias).float(), 6e-3)
    # Against the bf16 product of the unquantized activations: what per-token quantization
    # costs (e4m3 keeps 3 mantissa bits: ~2-3% rms relative on Gaussian data).
    exact = torch_ops.linear(x, torch_ops.dequantize_rows(q, scale, BF16), bias)
    check_rel(out.float(), exact.float(), 5e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_skinny_linear_fp8_weight(device: str, check_rel) -> None:
    n, k, dtype = (40, 96, F32) if device == "cpu" else (4096, 4096, BF16)
    q, scale = _fp8_weight(n, k, device)
    x = torch.randn(1, k, device=device).to(dtype)
    bias = torch.randn(n, device=device).to(dtype)
    want = torch_ops.linear(x, torch_ops.dequantize_rows(q, scale, dtype), bias)
    check_rel(skinny_linear(x, q, bias, weight_scale=scale).float(), want.float(),
              1e-5 if dtype == F32 else 8e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_gemvs_fp8_weight(device: str, check_rel) -> None:
    n, k, dtype = (40, 96, F32) if device == "cpu" else (6144, 4096, BF16)
    tol = 1e-5 if dtype == F32 else 1.5e-2
    q, scale = _fp8_weight(n, k, device)
    w = torch_ops.dequantize_rows(q, scale, dtype)
    h, res = (torch.randn(1, k, device=device).to(dtype) for _ in range(2))
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    out, new_res = norm_linear(h, res, g, EPS, q, None, weight_scale=scale)
    want, want_res = norm_linear(h, res, g, EPS, w, None)
    check_rel(out.float(), want.float(), tol)
    assert torch.equal(new_res, want_res)
    gate_up = torch.randn(1, 2 * k, device=device).to(dtype)
    check_rel(act_linear(gate_up, q, None, weight_scale=scale).float(),
              act_linear(gate_up, w, None).float(), tol)


# The batch-1 reductions other than the tile accumulator (skinny_gemm's module docstring): an
# in-thread partial sum of 16 products, and the tensor cores on x's fp16 hi / lo rows (16 and
# 64 rows of A), on several K tiles.
GEMV_REDUCTIONS = [SkinnyConfig(1, 32, 32, vec=16, num_stages=3),
                   SkinnyConfig(1, 16, 32, mma_rows=16, num_stages=3),
                   SkinnyConfig(1, 64, 32, mma_rows=64, num_stages=2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", GEMV_REDUCTIONS, ids=["vec16", "mma16", "mma64"])
def test_gemv_reductions_fp8_weight(device: str, config: SkinnyConfig, check_rel) -> None:
    """skinny_linear, norm_linear, act_linear and the fused qkv on an fp8 weight with each
    reduction: the default kernels' results on the dequantized weight, to float32 rounding on
    the CPU (float32; x of +-1e4 for the hi / lo split) and bf16's on the GPU."""
    if device == "cpu":
        n, k, dtype, tol, heads, kvh, d = 64, 96, F32, 2e-6, 4, 2, 32
    else:
        n, k, dtype, tol, heads, kvh, d = 4096, 4096, BF16, 8e-3, 32, 8, 128
        config = config._replace(block_n=2 * config.block_n, block_k=4 * config.block_k)
    q, scale = _fp8_weight(n, k, device)
    w = torch_ops.dequantize_rows(q, scale, dtype)
    x = (torch.randn(1, k, device=device) * torch.logspace(-3, 4, k, device=device)).to(dtype)
    check_rel(skinny_linear(x, q, None, weight_scale=scale, config=config).float(),
              skinny_linear(x, w, None).float(), tol)
    h, res = (torch.randn(1, k, device=device).to(dtype) for _ in range(2))
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    out, new_res = norm_linear(h, res, g, EPS, q, None, weight_scale=scale, config=config)
    want, want_res = norm_linear(h, res, g, EPS, w, None)
    check_rel(out.float(), want.float(), tol)
    assert torch.equal(new_res, want_res)
    gate_up = torch.randn(1, 2 * k, device=device).to(dtype) * 8
    check_rel(act_linear(gate_up, q, None, weight_scale=scale, config=config).float(),
              act_linear(gate_up, w, None).float(), tol)
    nq = (heads + 2 * kvh) * d
    q8, s8 = _fp8_weight(nq, k, device)
    w8 = torch_ops.dequantize_rows(q8, s8, dtype)
    freqs = torch.arange(600, device=device, dtype=F32)[:, None] * (
        1.0 / 10000 ** (torch.arange(0, d, 2, device=device, dtype=F32) / d))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    pos, slot = torch.tensor([517], device=device), torch.tensor([13], device=device)
    qkv_config = config._replace(block_n=max(config.block_n, 32 if config.mma_rows else 0))
    got = []
    for weight, ws, cfg in ((q8, s8, qkv_config), (w8, None, None)):
        kc, vc = (torch.zeros(6, 4, kvh, d, device=device, dtype=dtype) for _ in range(2))
        rq, _ = norm_qkv_rotary_store(h, res, g, EPS, weight, None, pos, cos_sin, kc, vc, slot,
                                      heads, config=cfg, weight_scale=ws)
        got.append((rq, kc, vc))
    for a, b in zip(*got, strict=True):
        check_rel(a.float(), b.float(), tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_and_act_quantize_in_the_same_launch(device: str, with_residual: bool) -> None:
    """rms_norm_fp8 / silu_and_mul_fp8 = the kernels in turn (norm or activation, then
    quantize_per_token): on the GPU bit for bit, the same scales and residual; against the torch
    reference (quantize_rows of torch_ops' norm / activation) within one e4m3 step, since the
    kernels' exp and rsqrt may move a bf16 value by one ulp."""
    m, k, dtype = (5, 80, F32) if device == "cpu" else (300, 4096, BF16)
    x = (torch.randn(m, k, device=device) * 3).to(dtype)
    x[1] = 0
    res = torch.randn(m, k, device=device).to(dtype) if with_residual else None
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    gate_up = (torch.randn(m, 2 * k, device=device) * 2).to(dtype)
    q, scale, new_res = norm_act.rms_norm_fp8(x, g, EPS, res)
    assert torch.equal(new_res, torch_ops.rms_norm(x, g, EPS, res)[1])
    fused = [(q, scale), norm_act.silu_and_mul_fp8(gate_up)]
    in_turn = [fp8_linear.quantize_per_token(norm_act.rms_norm(x, g, EPS, res)[0]),
               fp8_linear.quantize_per_token(norm_act.silu_and_mul(gate_up))]
    reference = [torch_ops.quantize_rows(torch_ops.rms_norm(x, g, EPS, res)[0]),
                 torch_ops.quantize_rows(torch_ops.silu_and_mul(gate_up))]
    for (q, scale), (q1, scale1), (q2, scale2) in zip(fused, in_turn, reference, strict=True):
        torch.testing.assert_close(scale, scale1, rtol=1e-6, atol=0)
        torch.testing.assert_close(scale, scale2, rtol=2e-2 if dtype == BF16 else 1e-5, atol=0)
        if device == "cuda":
            assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8))
        _assert_fp8_close(q, q2, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [17, 256])
def test_ops_norm_and_act_linear_fp8_weight_many_rows(m: int, check_rel) -> None:
    """The CUDA ops above the GEMVs' batch: norm (or activation) quantizing in its own launch,
    then _scaled_mm; against the reference W8A8 of the reference norm / activation."""
    from common.models.fp8 import Fp8Weight
    from common.models.ops_triton import act_linear as ops_act_linear
    from common.models.ops_triton import norm_linear as ops_norm_linear
    n, k = 6144, 4096
    w = Fp8Weight(*_fp8_weight(n, k, "cuda"))
    h, res = (torch.randn(m, k, device="cuda").to(BF16) for _ in range(2))
    g = (1 + 0.1 * torch.randn(k, device="cuda")).to(BF16)
    out, new_res = ops_norm_linear(h, res, g, EPS, w, None)
    normed, want_res = torch_ops.rms_norm(h, g, EPS, res)
    assert torch.equal(new_res, want_res)
    check_rel(out.float(), torch_ops.fp8_linear(normed.float(), *w).float(), 6e-3)
    gate_up = torch.randn(m, 2 * k, device="cuda").to(BF16)
    out = ops_act_linear(gate_up, w, None)
    want = torch_ops.fp8_linear(torch_ops.silu_and_mul(gate_up).float(), *w)
    check_rel(out.float(), want.float(), 6e-3)


def _paged(seq_lens: list[int], kv_heads: int, d: int, device: str, make_paged
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8 pools (values up to ~+-8, so every e4m3 range is used) and their block tables."""
    k, v, tables = make_paged(seq_lens, 16, kv_heads, d, F32, device)
    return torch_ops.to_fp8(k * 3), torch_ops.to_fp8(v * 3), tables


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_fp8_pool(device: str, make_paged, check_rel) -> None:
    """The kernel reads the fp8 pool as the reference does (a cast: scale 1.0)."""
    (h, kvh, d), lens = ((4, 2, 32), [1, 40, 17]) if device == "cpu" else \
        ((32, 8, 128), [4096, 1, 1000, 2500])
    dtype = F32 if device == "cpu" else BF16
    k, v, tables = _paged(lens, kvh, d, device, make_paged)
    q = torch.randn(len(lens), h, d, device=device).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_attention_decode(q, k, v, tables, seq_lens, d ** -0.5)
    want = torch_ops.paged_attention_decode(q.float(), k, v, tables, seq_lens, d ** -0.5)
    check_rel(out.float(), want, 1e-5 if dtype == F32 else 1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("widen_v_first,pairs", [(True, False), (False, False), (True, True)],
                         ids=["v-first", "v-late", "pairs"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_fp8_pool_16bit_q(device: str, widen_v_first: bool, pairs: bool,
                                           num_splits: int, make_paged, check_rel) -> None:
    """A bf16 q on an fp8 pool: the tiles widen to fp16 for the dots, V before shared memory
    or after (DecodeConfig.widen_v_first), or the pool read as 16-bit pairs and both widened
    after it (fp8_pairs); whole or split context, fused merge or not."""
    (h, kvh, d), lens = ((8, 2, 32), [1, 70, 17]) if device == "cpu" else \
        ((32, 8, 128), [4096, 1, 1000, 2500])
    k, v, tables = _paged(lens, kvh, d, device, make_paged)
    q = torch.randn(len(lens), h, d, device=device).to(BF16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    want = torch_ops.paged_attention_decode(q.float(), k, v, tables, seq_lens, d ** -0.5)
    for block_n, fused in ((16, False), (128, True)):
        cfg = DecodeConfig(block_n=block_n, fused_merge=fused, widen_v_first=widen_v_first,
                           fp8_pairs=pairs)
        out = torch.full_like(q, float("nan"))
        paged_attention_decode(q, k, v, tables, seq_lens, d ** -0.5, out=out,
                               num_splits=num_splits, config=cfg)
        check_rel(out.float(), want, 1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [32, 48])
def test_decode_attention_fp8_pairs(device: str, head_dim: int, make_paged, check_rel) -> None:
    """The pool read as 16-bit pairs (DecodeConfig.fp8_pairs, with the block table read a tile
    ahead or not) computes what the byte-wise read does: K and V pools of other strides (V a
    slice of a wider pool), one split or three, a partial last tile; head_dim 48 (no power of
    two) takes the byte-wise read."""
    h, kvh = 8, 2
    lens = [64, 5, 77, 1, 130]
    k, v, tables = make_paged(lens, 16, kvh, head_dim, F32, device)
    k = torch_ops.to_fp8(k * 3)
    wide = torch.randn(v.shape[0], 16, kvh + 1, head_dim, device=device)
    wide[:, :, :kvh] = v
    v = torch_ops.to_fp8(wide * 3)[:, :, :kvh]
    q = torch.randn(len(lens), h, head_dim, device=device).to(BF16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    want = torch_ops.paged_attention_decode(q.float(), k.float(), v.float(), tables, seq_lens,
                                            head_dim ** -0.5)
    for num_splits, fused in ((1, False), (3, True), (3, False)):
        outs = []
        for pairs, ahead in ((True, False), (True, True), (False, False)):
            cfg = DecodeConfig(block_n=32, fused_merge=fused, fp8_pairs=pairs,
                               prefetch_table=ahead)
            out = torch.full_like(q, float("nan"))
            paged_attention_decode(q, k, v, tables, seq_lens, head_dim ** -0.5, out=out,
                                   num_splits=num_splits, config=cfg)
            outs.append(out.float())
        check_rel(outs[0], want, 1e-2)
        check_rel(outs[0], outs[1], 1e-6)  # the same arithmetic, loads in another order
        check_rel(outs[0], outs[2], 5e-3)  # the same products, summed in another order


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pool", ["fp8", "16bit"])
@pytest.mark.parametrize("head_dim", [32, 48])
def test_decode_attention_peeled_loop(device: str, pool: str, head_dim: int, make_paged,
                                      check_rel) -> None:
    """The loop over whole tiles without masks, then the partial tile (DecodeConfig.peel; on the
    GPU an fp8 V widened by inline asm in the whole tiles), computes what the masked loop does:
    contexts of whole tiles only, of a partial tile only and of both, one split or three, a head
    dimension under its power of two (48: the dimension mask stays). The 16-bit pool is bf16 on
    the GPU, float32 on the CPU (the interpreter's bf16 dot is not the compiled one)."""
    h, kvh = 8, 2
    lens = [64, 5, 77, 1, 130]
    k, v, tables = make_paged(lens, 16, kvh, head_dim, F32, device)
    dtype = BF16 if device == "cuda" or pool == "fp8" else F32
    if pool == "fp8":
        k, v = torch_ops.to_fp8(k * 3), torch_ops.to_fp8(v * 3)
    else:
        k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(len(lens), h, head_dim, device=device).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    for num_splits in (1, 3):
        outs = []
        for peel in (True, False):
            cfg = DecodeConfig(block_n=32, peel=peel, asm_widen=peel)
            outs.append(paged_attention_decode(q, k, v, tables, seq_lens, head_dim ** -0.5,
                                               num_splits=num_splits, config=cfg).float())
        check_rel(outs[0], outs[1], 1e-5)
        want = torch_ops.paged_attention_decode(q.float(), k.float(), v.float(), tables,
                                                seq_lens, head_dim ** -0.5)
        check_rel(outs[0], want, 1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_extend_attention_fp8_pool(device: str, make_paged, check_rel) -> None:
    (h, kvh, d), lens, q_lens = ((4, 2, 32), [20, 9], [5, 9]) if device == "cpu" else \
        ((32, 8, 128), [1500, 700], [300, 700])
    dtype = F32 if device == "cpu" else BF16
    k, v, tables = _paged(lens, kvh, d, device, make_paged)
    q = torch.randn(sum(q_lens), h, d, device=device).to(dtype)
    qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_attention_extend(q, k, v, tables, qsl, seq_lens, d ** -0.5)
    want = torch_ops.paged_attention_extend(q.float(), k, v, tables, qsl, seq_lens, d ** -0.5)
    check_rel(out.float(), want, 1e-5 if dtype == F32 else 1e-2)


def _assert_fp8_equal(got: torch.Tensor, want: torch.Tensor, device: str) -> None:
    if device == "cuda":  # round to nearest even, saturating, as torch's cast after the clamp
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        _assert_fp8_close(got, want, device)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_store_into_fp8_pool(device: str) -> None:
    """store_kv and rotary_store_kv write saturated e4m3 (values beyond 448 included), slots
    of -1 write nothing, and the reference store agrees."""
    kvh, d = 2, 32
    k = torch.randn(3, kvh, d, device=device) * 200
    v = torch.randn(3, kvh, d, device=device)
    slots = torch.tensor([0, -1, 9], device=device)
    got_k = torch.zeros(4, 4, kvh, d, device=device, dtype=FP8)
    got_v = torch.zeros_like(got_k)
    want_k, want_v = torch.zeros_like(got_k), torch.zeros_like(got_v)
    kv_store.store_kv(k, v, got_k, got_v, slots)
    torch_ops.store_kv(k, v, want_k, want_v, slots)
    assert want_k.float().abs().max() == 448.0 and not want_k.float().isnan().any()
    _assert_fp8_equal(got_k, want_k, device)
    _assert_fp8_equal(got_v, want_v, device)
    assert not got_k.view(torch.uint8).view(16, kvh, d)[[1, 2, 3, 4, 5, 6, 7, 8]].any()

    q = torch.randn(3, 4, d, device=device)
    pos = torch.tensor([3, 70, 5], device=device)
    freqs = torch.arange(100, device=device, dtype=F32)[:, None] * (
        1.0 / 10000 ** (torch.arange(0, d, 2, device=device, dtype=F32) / d))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    got_k.zero_()
    kv_store.rotary_store_kv(q, k, v, pos, cos_sin, got_k, got_v, slots)
    _, rot_k = torch_ops.apply_rotary(q, k, pos, cos_sin)
    want_k.zero_()
    torch_ops.store_kv(rot_k, v, want_k, want_v, slots)
    _assert_fp8_equal(got_k, want_k, device)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_qkv_fp8_weight_and_pool(device: str, check_rel) -> None:
    """norm + qkv GEMV on an fp8 weight, rotary, and the new K/V into an fp8 pool: the same as
    the bf16/fp32 weights dequantized, through the unfused reference, stored as e4m3."""
    heads, kvh, d, k = (4, 2, 16, 64) if device == "cpu" else (32, 8, 128, 4096)
    dtype = F32 if device == "cpu" else BF16
    n = (heads + 2 * kvh) * d
    q8, scale = _fp8_weight(n, k, device)
    w = torch_ops.dequantize_rows(q8, scale, dtype)
    h, res = (torch.randn(1, k, device=device).to(dtype) for _ in range(2))
    g = torch.ones(k, device=device, dtype=dtype)
    freqs = torch.arange(600, device=device, dtype=F32)[:, None] * (
        1.0 / 10000 ** (torch.arange(0, d, 2, device=device, dtype=F32) / d))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    pos, slot = torch.tensor([517], device=device), torch.tensor([13], device=device)
    kc, vc = (torch.zeros(6, 4, kvh, d, device=device, dtype=FP8) for _ in range(2))
    got_q, _ = norm_qkv_rotary_store(h, res, g, EPS, q8, None, pos, cos_sin, kc, vc, slot,
                                     heads, weight_scale=scale)
    ref_kc, ref_vc = (torch.zeros(6, 4, kvh, d, device=device, dtype=dtype) for _ in range(2))
    want_q, _ = norm_qkv_rotary_store(h, res, g, EPS, w, None, pos, cos_sin, ref_kc, ref_vc,
                                      slot, heads)
    tol = 1e-5 if dtype == F32 else 1.5e-2
    check_rel(got_q.float(), want_q.float(), tol)
    # The pool holds the e4m3 rounding of what the full-precision pool got: one step apart
    # where the two GEMVs' sums round to opposite sides of a boundary, plus a few subnormal
    # steps near zero (the GEMVs differ by ~1e-3 absolute, a bf16 ulp of the heads' values,
    # more than the 2^-9 between subnormals; measured on the H200: two steps).
    for got, want in ((kc, ref_kc), (vc, ref_vc)):
        _assert_fp8_close(got[3, 1], torch_ops.to_fp8(want[3, 1]), device, atol=2.0 ** -6)
        assert got.float().count_nonzero() == got[3, 1].float().count_nonzero()
