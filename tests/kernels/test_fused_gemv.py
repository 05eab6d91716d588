"""kernels.fused_gemv against the unfused reference ops (torch_ops.rms_norm / silu_and_mul, then
torch_ops.linear), on the interpreter (CPU) and on real Llama-3-8B shapes (GPU)."""

from __future__ import annotations

import pytest
import torch

from common.models.ops import REFERENCE_OPS
from kernels import torch_ops
from kernels.fused_gemv import act_linear, norm_linear, supports

F32, BF16 = torch.float32, torch.bfloat16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# The fused norm keeps the normed activations in float32 where the unfused path rounds them
# twice to the input dtype: bf16 outputs differ by about one bf16 ulp of the activations.
TOL = {F32: 1e-5, BF16: 1.5e-2}
EPS = 1e-5


def _weights(n: int, k: int, dtype: torch.dtype, device: str, bias: bool,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    return w, (torch.randn(n, device=device).to(dtype) if bias else None)


def _want_norm(h, residual, g, w, b):
    x, new_res = torch_ops.rms_norm(h, g, EPS, residual)
    return torch_ops.linear(x, w, b), new_res


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("n,k", [(40, 48), (33, 1040)])
def test_norm_linear(device: str, n: int, k: int, dtype: torch.dtype, bias: bool,
                     with_residual: bool, check_rel) -> None:
    if device == "cuda":
        n, k = 6144, 4096
    h = (torch.randn(1, k, device=device) * 3).to(dtype)
    residual = torch.randn(1, k, device=device).to(dtype) if with_residual else None
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    w, b = _weights(n, k, dtype, device, bias)
    old_residual = None if residual is None else residual.clone()
    out, new_res = norm_linear(h, residual, g, EPS, w, b)
    want, want_res = _want_norm(h, residual, g, w, b)
    assert out.shape == (1, n) and out.dtype == dtype
    check_rel(out.float(), want.float(), TOL[dtype])
    if device == "cuda" or dtype == F32:   # the interpreter's bf16 conversion truncates
        assert torch.equal(new_res, want_res)   # the add rounds as the unfused one does
    else:
        check_rel(new_res.float(), want_res.float(), TOL[dtype])
    if residual is not None:
        assert torch.equal(residual, old_residual) and new_res.data_ptr() != h.data_ptr()
    else:
        assert new_res is h


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("n,k", [(40, 48), (17, 1100)])
def test_act_linear(device: str, n: int, k: int, dtype: torch.dtype, bias: bool,
                    check_rel) -> None:
    if device == "cuda":
        n, k = 4096, 14336
    gate_up = (torch.randn(1, 2 * k, device=device) * 2).to(dtype)
    w, b = _weights(n, k, dtype, device, bias)
    out = act_linear(gate_up, w, b)
    want = torch_ops.linear(torch_ops.silu_and_mul(gate_up), w, b)
    assert out.shape == (1, n) and out.dtype == dtype
    # Same roundings as the unfused ops (on the GPU; the interpreter's bf16 conversion
    # truncates): only the float32 summation order differs.
    tol = TOL[F32] if dtype == F32 else 8e-3 if device == "cuda" else TOL[BF16]
    check_rel(out.float(), want.float(), tol)


def test_reference_ops_compose() -> None:
    """The CPU path's fused ops are exactly the two ops in turn."""
    h, res = torch.randn(3, 32), torch.randn(3, 32)
    g, w = torch.randn(32), torch.randn(16, 32)
    out, new_res = REFERENCE_OPS.norm_linear(h, res, g, EPS, w, None)
    x, want_res = torch_ops.rms_norm(h, g, EPS, res)
    assert torch.equal(out, torch.nn.functional.linear(x, w)) and torch.equal(new_res, want_res)
    gate_up = torch.randn(3, 64)
    assert torch.equal(REFERENCE_OPS.act_linear(gate_up, w, None),
                       torch.nn.functional.linear(torch_ops.silu_and_mul(gate_up), w))


def test_rejects_bad_arguments() -> None:
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match="h: expected shape"):
        norm_linear(torch.randn(2, 32), None, torch.ones(32), EPS, w)
    with pytest.raises(ValueError, match="norm_weight: expected shape"):
        norm_linear(torch.randn(1, 32), None, torch.ones(31), EPS, w)
    with pytest.raises(ValueError, match="residual: expected shape"):
        norm_linear(torch.randn(1, 32), torch.randn(1, 33), torch.ones(32), EPS, w)
    with pytest.raises(ValueError, match="h: expected shape"):
        act_linear(torch.randn(1, 32), w)   # gate | up is 2K wide
    assert not supports(torch.randn(1, 32), w)   # not CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_supports_on_cuda() -> None:
    w = torch.randn(32, 64, device="cuda", dtype=BF16)
    x = torch.randn(1, 64, device="cuda", dtype=BF16)
    assert supports(x, w) and supports(torch.randn(1, 128, device="cuda", dtype=BF16), w)
    assert not supports(torch.randn(2, 64, device="cuda", dtype=BF16), w)
    assert not supports(x.float(), w.float())
    assert not supports(x, w.requires_grad_())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay(check_rel) -> None:
    """Captured once, replayed on new inputs: the residual output follows the new inputs."""
    k, n = 4096, 6144
    h, res = (torch.randn(1, k, device="cuda", dtype=BF16) for _ in range(2))
    g = torch.ones(k, device="cuda", dtype=BF16)
    w, _ = _weights(n, k, BF16, "cuda", False)
    norm_linear(h, res, g, EPS, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_res = norm_linear(h, res, g, EPS, w)
    for _ in range(2):
        h.copy_(torch.randn_like(h))
        graph.replay()
        want, want_res = _want_norm(h, res, g, w, None)
        check_rel(out.float(), want.float(), TOL[BF16])
        assert torch.equal(new_res, want_res)
