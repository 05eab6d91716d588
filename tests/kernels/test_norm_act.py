"""kernels.norm_act against torch_ops.rms_norm and torch_ops.silu_and_mul."""

from __future__ import annotations

import pytest
import torch

from kernels import torch_ops
from kernels.norm_act import rms_norm, silu_and_mul

F32, BF16 = torch.float32, torch.bfloat16

# (leading shape, hidden, x dtype, weight dtype)
NORMS = [
    pytest.param("cpu", (3, 5), 40, F32, F32, id="cpu-f32"),
    pytest.param("cpu", (7,), 64, F32, F32, id="cpu-pow2"),
    pytest.param("cuda", (300,), 4096, BF16, BF16, id="cuda-bf16", marks=pytest.mark.gpu),
    pytest.param("cuda", (4, 33), 576, BF16, F32, id="cuda-bf16-f32-weight",
                 marks=pytest.mark.gpu),
    pytest.param("cuda", (65,), 8192, F32, F32, id="cuda-f32", marks=pytest.mark.gpu),
]


def _tol(dtype: torch.dtype) -> float:
    return 1e-6 if dtype == F32 else 1e-2


@pytest.mark.parametrize("device,lead,hidden,dtype,w_dtype", NORMS)
def test_rms_norm_with_residual(device, lead, hidden, dtype, w_dtype, check_rel) -> None:
    x = torch.randn(*lead, hidden, device=device).to(dtype)
    residual = torch.randn(*lead, hidden, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(w_dtype)
    want, want_res = torch_ops.rms_norm(x, weight, 1e-5, residual)
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan"))
    got, got_res = rms_norm(x, weight, 1e-5, residual, out=out, residual_out=res_out)
    assert got is out and got_res is res_out
    assert torch.equal(got_res, want_res)  # one rounding of x + residual, as the reference
    check_rel(got.float(), want.float(), _tol(dtype))


@pytest.mark.parametrize("device,lead,hidden,dtype,w_dtype", NORMS)
def test_rms_norm_without_residual(device, lead, hidden, dtype, w_dtype, check_rel) -> None:
    x = torch.randn(*lead, hidden, device=device).to(dtype)
    weight = torch.randn(hidden, device=device).to(w_dtype)
    want, _ = torch_ops.rms_norm(x, weight, 1e-6)
    got, res = rms_norm(x, weight, 1e-6)
    assert res is x
    check_rel(got.float(), want.float(), _tol(dtype))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rms_norm_residual_in_place(device: str, check_rel) -> None:
    x = torch.randn(6, 48, device=device)
    residual = torch.randn(6, 48, device=device)
    weight = torch.randn(48, device=device)
    want, want_res = torch_ops.rms_norm(x, weight, 1e-6, residual.clone())
    got, got_res = rms_norm(x, weight, 1e-6, residual, residual_out=residual)
    assert got_res is residual and torch.equal(residual, want_res)
    check_rel(got, want, 1e-6)


ACTS = [
    pytest.param("cpu", (3, 2), 70, F32, id="cpu-f32"),
    pytest.param("cuda", (257,), 14336, BF16, id="cuda-bf16", marks=pytest.mark.gpu),
    pytest.param("cuda", (5, 3), 1536, F32, id="cuda-f32", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device,lead,n,dtype", ACTS)
def test_silu_and_mul(device, lead, n, dtype, check_rel) -> None:
    x = torch.randn(*lead, 2 * n, device=device).to(dtype)
    out = torch.full((*lead, n), float("nan"), device=device, dtype=dtype)
    assert silu_and_mul(x, out=out) is out
    check_rel(out.float(), torch_ops.silu_and_mul(x).float(), _tol(dtype))


def test_rejects_bad_arguments() -> None:
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="weight: expected shape"):
        rms_norm(x, torch.randn(15), 1e-6)
    with pytest.raises(ValueError, match="residual: dtype"):
        rms_norm(x, torch.randn(16), 1e-6, x.double())
    with pytest.raises(ValueError, match="not 2 \\* n"):
        silu_and_mul(torch.randn(4, 15))
