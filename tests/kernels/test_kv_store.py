"""kernels.kv_store against torch_ops.store_kv and torch_ops.apply_rotary."""

from __future__ import annotations

import pytest
import torch

from kernels import torch_ops
from kernels.kv_store import rotary_store_kv, store_kv

F32, BF16 = torch.float32, torch.bfloat16

# (tokens, heads, kv_heads, head_dim, block_size, num_blocks, input dtype, cache dtype)
SHAPES = [
    pytest.param("cpu", (9, 6, 3, 32, 4, 5, F32, F32), id="cpu-gqa2"),
    pytest.param("cpu", (4, 2, 2, 16, 8, 3, F32, F32), id="cpu-gqa1"),
    pytest.param("cuda", (300, 32, 8, 128, 16, 40, BF16, BF16), id="cuda-llama8b-bf16",
                 marks=pytest.mark.gpu),
    pytest.param("cuda", (77, 9, 3, 64, 16, 9, F32, BF16), id="cuda-smollm-f32-into-bf16",
                 marks=pytest.mark.gpu),
]


def _inputs(shape: tuple, device: str):
    t, h, kvh, d, bs, nb, dtype, cache_dtype = shape
    key = torch.randn(t, kvh, d, device=device).to(dtype)
    value = torch.randn(t, kvh, d, device=device).to(dtype)
    # The old cache contents stand in for poison: untouched slots must keep them exactly.
    k_cache = torch.randn(nb, bs, kvh, d, device=device).to(cache_dtype)
    v_cache = torch.randn(nb, bs, kvh, d, device=device).to(cache_dtype)
    slots = torch.randperm(nb * bs, device=device)[:t]
    slots[::4] = -1  # padding tokens
    return key, value, k_cache, v_cache, slots


def _cos_sin(max_pos: int, d: int, device: str) -> torch.Tensor:
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return torch.cat((ang.cos(), ang.sin()), dim=-1).float().to(device)


@pytest.mark.parametrize("device,shape", SHAPES)
def test_store_kv_exact(device: str, shape: tuple) -> None:
    key, value, k_cache, v_cache, slots = _inputs(shape, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    torch_ops.store_kv(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("device,shape", SHAPES)
def test_rotary_store_kv(device: str, shape: tuple, check_rel) -> None:
    key, value, k_cache, v_cache, slots = _inputs(shape, device)
    t, h, _, d = shape[0], shape[1], shape[2], shape[3]
    q = torch.randn(t, h, d, device=device).to(key.dtype)
    positions = torch.randint(0, 4096, (t,), device=device)
    cos_sin = _cos_sin(4096, d, device)
    q_ref, k_rot = torch_ops.apply_rotary(q, key, positions, cos_sin)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    torch_ops.store_kv(k_rot, value, k_ref, v_ref, slots)

    q_out = torch.full_like(q, float("nan"))
    assert rotary_store_kv(q, key, value, positions, cos_sin, k_cache, v_cache, slots,
                           q_out=q_out) is q_out
    # Same float32 formula; the GPU may contract a*b - c*d into one fma, so not bit-exact.
    tol = 1e-6 if key.dtype == F32 and k_cache.dtype == F32 else 1e-2
    check_rel(q_out, q_ref, 1e-6 if key.dtype == F32 else 1e-2)
    written = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    k_flat, k_ref_flat = k_cache.flatten(0, 1), k_ref.flatten(0, 1)
    assert torch.equal(k_flat[~written], k_ref_flat[~written])
    check_rel(k_flat[written], k_ref_flat[written], tol)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rotary_in_place_q(device: str) -> None:
    key, value, k_cache, v_cache, slots = _inputs((5, 4, 2, 16, 4, 3, F32, F32), device)
    q = torch.randn(5, 4, 16, device=device)
    positions = torch.arange(5, device=device)
    cos_sin = _cos_sin(8, 16, device)
    q_ref, _ = torch_ops.apply_rotary(q, key, positions, cos_sin)
    rotary_store_kv(q, key, value, positions, cos_sin, k_cache, v_cache, slots, q_out=q)
    assert torch.allclose(q, q_ref, rtol=1e-6, atol=1e-6)


def test_rejects_bad_arguments() -> None:
    key, value, k_cache, v_cache, slots = _inputs((5, 4, 2, 16, 4, 3, F32, F32), "cpu")
    with pytest.raises(ValueError, match="slot_mapping: dtype"):
        store_kv(key, value, k_cache, v_cache, slots.int())
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        store_kv(key, value, k_cache[:, :, :1], v_cache, slots)
    with pytest.raises(ValueError, match="cos_sin: expected shape"):
        rotary_store_kv(torch.randn(5, 4, 16), key, value, torch.arange(5),
                        torch.randn(8, 8), k_cache, v_cache, slots)
