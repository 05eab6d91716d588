"""kernels.fused_qkv against its unfused pair (fused_gemv.norm_linear, then
kv_store.rotary_store_kv), on the interpreter (CPU) and on the Llama-3-8B shape (GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_gemv import norm_linear
from kernels.fused_qkv import norm_qkv_rotary_store, supports_qkv
from kernels.kv_store import rotary_store_kv

F32, BF16 = torch.float32, torch.bfloat16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
EPS = 1e-5
# (heads, kv_heads, head_dim, hidden) per device; the GPU case is Llama-3-8B's attention.
SHAPES = {"cpu": [(4, 2, 16, 64), (2, 1, 32, 48)], "cuda": [(32, 8, 128, 4096)]}


def _case(device: str, heads: int, kv_heads: int, d: int, k: int, dtype: torch.dtype,
          bias: bool, with_residual: bool):
    n = (heads + 2 * kv_heads) * d
    h = (torch.randn(1, k, device=device) * 2).to(dtype)
    residual = torch.randn(1, k, device=device).to(dtype) if with_residual else None
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    pos = torch.arange(1000, device=device, dtype=F32)[:, None]
    freqs = pos * (1.0 / 10000 ** (torch.arange(0, d, 2, device=device, dtype=F32) / d))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    caches = [torch.randn(6, 4, kv_heads, d, device=device).to(dtype) for _ in range(2)]
    return h, residual, g, w, b, cos_sin, caches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [0, 1])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("bias,with_residual", [(False, True), (True, False)])
@pytest.mark.parametrize("slot", [13, -1])
def test_matches_the_unfused_ops(device: str, shape: int, dtype: torch.dtype, bias: bool,
                                 with_residual: bool, slot: int, check_rel) -> None:
    if shape >= len(SHAPES[device]):
        pytest.skip("one shape on this device")
    heads, kv_heads, d, k = SHAPES[device][shape]
    h, residual, g, w, b, cos_sin, (kc, vc) = _case(device, heads, kv_heads, d, k, dtype, bias,
                                                    with_residual)
    positions = torch.tensor([517], device=device)
    slots = torch.tensor([slot], device=device)
    qkv, want_res = norm_linear(h, residual, g, EPS, w, b)
    q, key, value = qkv.view(1, heads + 2 * kv_heads, d).split([heads, kv_heads, kv_heads], 1)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q = rotary_store_kv(q, key, value, positions, cos_sin, want_kc, want_vc, slots)

    got_q, got_res = norm_qkv_rotary_store(h, residual, g, EPS, w, b, positions, cos_sin,
                                           kc, vc, slots, heads)
    tol = 1e-5 if dtype == F32 else 1.5e-2   # the interpreter's bf16 conversion truncates
    assert got_q.shape == (1, heads, d)
    check_rel(got_q.float(), want_q.float(), tol)
    assert torch.equal(got_res, want_res)
    if slot < 0:
        assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    else:
        block, row = divmod(slot, kc.shape[1])
        check_rel(kc[block, row].float(), want_kc[block, row].float(), tol)
        check_rel(vc[block, row].float(), want_vc[block, row].float(), tol)
        kc[block, row] = want_kc[block, row]   # every other slot untouched
        vc[block, row] = want_vc[block, row]
        assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_supports_qkv_and_bad_arguments() -> None:
    h, _, g, w, _, cos_sin, (kc, vc) = _case("cpu", 4, 2, 16, 64, F32, False, False)
    assert not supports_qkv(h, w, None, 4, 2, 16)   # not CUDA
    one = torch.tensor([3])
    with pytest.raises(ValueError, match="weight: expected shape"):
        norm_qkv_rotary_store(h, None, g, EPS, w[:-16], None, one, cos_sin, kc, vc, one, 4)
    with pytest.raises(ValueError, match="slot_mapping: expected shape"):
        norm_qkv_rotary_store(h, None, g, EPS, w, None, one, cos_sin, kc, vc,
                              torch.tensor([1, 2]), 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_supports_qkv_on_cuda() -> None:
    h = torch.randn(1, 4096, device="cuda", dtype=BF16)
    w = torch.randn(6144, 4096, device="cuda", dtype=BF16)
    assert supports_qkv(h, w, None, 32, 8, 128)
    assert not supports_qkv(h, w, None, 32, 4, 128)   # rows do not match the heads
    assert not supports_qkv(torch.randn(2, 4096, device="cuda", dtype=BF16), w, None, 32, 8, 128)
