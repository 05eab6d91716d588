"""kernels.skinny_gemm against torch_ops.linear computed in float32."""

from __future__ import annotations

import pytest
import torch

from kernels import torch_ops
from kernels.skinny_gemm import MAX_M, SkinnyConfig, default_config, skinny_linear, supports

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}

# Llama-3-8B projections as the engine fuses them: name -> (N, K).
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336), "lm_head": (128256, 4096)}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, w, b


def _want(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch_ops.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(40, 48), (64, 96), (33, 80)])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_default_config(device: str, m: int, n: int, k: int, bias: bool, check_rel) -> None:
    x, w, b = _inputs(m, n, k, F32, device, bias)
    check_rel(skinny_linear(x, w, b), _want(x, w, b), TOL[F32])


# (M, N, K, config, dtype): several K tiles, ragged N and K, split-K with empty splits, the
# tl.dot path for one row, 16-bit inputs (the interpreter's tl.dot is wrong for bfloat16).
CONFIGS = [
    (1, 40, 48, SkinnyConfig(1, 8, 16), F32),
    (1, 33, 80, SkinnyConfig(1, 16, 32, num_stages=2), F32),
    (1, 33, 80, SkinnyConfig(1, 16, 32, split_k=2), F32),
    (1, 40, 64, SkinnyConfig(1, 4, 16, split_k=3), BF16),
    (1, 24, 48, SkinnyConfig(16, 16, 16), F32),
    (2, 40, 80, SkinnyConfig(16, 16, 32, split_k=2), F32),
    (5, 40, 96, SkinnyConfig(16, 16, 32, num_warps=2), F16),
    (16, 70, 32, SkinnyConfig(16, 32, 16, split_k=4), F32),
    (16, 17, 48, SkinnyConfig(16, 64, 16, num_stages=1), F16),
    (20, 36, 64, SkinnyConfig(32, 16, 16, split_k=3), F32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,config,dtype", CONFIGS)
def test_configs(device: str, m: int, n: int, k: int, config: SkinnyConfig,
                 dtype: torch.dtype, bias: bool, check_rel) -> None:
    x, w, b = _inputs(m, n, k, dtype, device, bias)
    out = skinny_linear(x, w, b, config=config)
    assert out.dtype == dtype and out.shape == (m, n)
    check_rel(out.float(), _want(x, w, b), TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 3])
def test_strided_rows(device: str, m: int, check_rel) -> None:
    """x and weight as column slices of wider tensors: row strides are not K."""
    x = torch.randn(m, 80, device=device)[:, 16:64]
    w = torch.randn(40, 96, device=device)[:, 8:56]
    check_rel(skinny_linear(x, w), _want(x, w, None), TOL[F32])


def test_default_config_every_row_count() -> None:
    """Valid for every M the launcher takes (the interpreter runs the two extremes)."""
    for n, k in [*LLAMA3_8B.values(), (40, 48)]:
        for m in range(1, MAX_M + 1):
            cfg = default_config(n, k, m)
            assert (cfg.block_m == 1) == (m == 1), cfg
            assert cfg.block_m >= m and cfg.split_k >= 1, cfg
            if m > 1:
                assert min(cfg.block_n, cfg.block_k) >= 16, cfg


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_max_rows(device: str, check_rel) -> None:
    x, w, _ = _inputs(MAX_M, 24, 32, F32, device, False)
    check_rel(skinny_linear(x, w), _want(x, w, None), TOL[F32])
    assert skinny_linear(x[:0], w).shape == (0, 24)


def test_rejects_bad_arguments() -> None:
    x, w = torch.randn(2, 32), torch.randn(24, 32)
    with pytest.raises(ValueError, match="weight: expected shape"):
        skinny_linear(x, torch.randn(24, 31))
    with pytest.raises(ValueError, match="weight: dtype"):
        skinny_linear(x, w.half())
    with pytest.raises(ValueError, match="bias: expected shape"):
        skinny_linear(x, w, torch.randn(23))
    with pytest.raises(ValueError, match="more than the"):
        skinny_linear(torch.randn(MAX_M + 1, 32), w)
    with pytest.raises(ValueError, match="block_m 1 serves one row"):
        skinny_linear(x, w, config=SkinnyConfig(1, 16, 16))
    with pytest.raises(ValueError, match="tl.dot needs"):
        skinny_linear(x, w, config=SkinnyConfig(16, 8, 16))
    with pytest.raises(ValueError, match="powers of two"):
        skinny_linear(x, w, config=SkinnyConfig(16, 24, 16))
    assert not supports(x, w)  # not CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_supports_on_cuda() -> None:
    x = torch.randn(1, 64, device="cuda", dtype=BF16)
    w = torch.randn(32, 64, device="cuda", dtype=BF16)
    assert supports(x, w) and supports(x, w, torch.randn(32, device="cuda", dtype=BF16))
    x4 = torch.randn(4, 64, device="cuda", dtype=BF16)
    assert not supports(x4, w) and supports(x4, w, max_m=4)  # cuBLAS serves M > 1 by default
    assert not supports(torch.randn(17, 64, device="cuda", dtype=BF16), w, max_m=16)
    assert not supports(x.float(), w.float())
    assert not supports(x[:, :40], w[:, :40])  # K not a multiple of 16
    assert not supports(x, w.t().contiguous().t())  # weight not contiguous along K
    assert not supports(x, w.requires_grad_())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("proj", list(LLAMA3_8B))
def test_llama3_8b_shapes(proj: str, m: int, check_rel) -> None:
    n, k = LLAMA3_8B[proj]
    x, w, b = _inputs(m, n, k, BF16, "cuda", bias=proj == "qkv")  # Qwen2 has a qkv bias
    check_rel(skinny_linear(x, w, b).float(), _want(x, w, b), TOL[BF16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", [SkinnyConfig(1, 16, 512), SkinnyConfig(16, 64, 128, 4)])
def test_cuda_graph_replay(config: SkinnyConfig, check_rel) -> None:
    """Captured once (split-K workspace included), replayed on new inputs."""
    x, w, b = _inputs(1, 4096, 4096, BF16, "cuda", bias=True)
    skinny_linear(x, w, b, config=config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w, b, config=config)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        check_rel(out.float(), _want(x, w, b), TOL[BF16])
