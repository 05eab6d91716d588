"""kernels.cpu_layer_ops against their references in kernels.torch_ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_layer_ops, torch_ops

pytestmark = pytest.mark.skipif(not cpu_layer_ops.available(),
                                reason="the CPU layer ops do not build here")

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, rows: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576 + 9, generator=g).to(dtype)[:, :576]  # rows strided
    res = torch.randn(rows, 576, generator=g).to(dtype) if with_residual else None
    w = torch.randn(576, generator=g).to(dtype)
    out, new_res = cpu_layer_ops.rms_norm(x, w, 1e-5, res)
    ref, ref_res = torch_ops.rms_norm(x, w, 1e-5, res)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    assert torch.equal(new_res, ref_res)


def test_rms_norm_float32_weight_of_bf16_rows() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g)
    out, _ = cpu_layer_ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, torch_ops.rms_norm(x, w, 1e-6)[0], **_tol(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_silu_and_mul(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1544, generator=g) * 6).to(dtype)  # a tail past 16 lanes
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])
    torch.testing.assert_close(cpu_layer_ops.silu_and_mul(x), torch_ops.silu_and_mul(x),
                               **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    heads, kvh, d, bs, nb, t = 9, 3, 64, 4, 12, 10
    qkv = torch.randn(t, (heads + 2 * kvh) * d, generator=g).to(dtype)
    positions = torch.randint(0, 100, (t,), generator=g)
    cos_sin = torch.randn(128, d, generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[3] = -1  # padding: not stored
    k_cache, v_cache = (torch.zeros(nb, bs, kvh, d, dtype=dtype) for _ in range(2))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q = cpu_layer_ops.rotary_store(qkv, heads, kvh, positions, cos_sin, k_cache, v_cache, slots)
    rq, rk, rv = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    ref_q, ref_rk = torch_ops.apply_rotary(rq.view(t, heads, d), rk.view(t, kvh, d), positions,
                                           cos_sin)
    torch_ops.store_kv(ref_rk, rv.view(t, kvh, d), ref_k, ref_v, slots)
    assert torch.equal(q, ref_q)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype,float32_out", [(torch.float32, False), (torch.bfloat16, True),
                                               (torch.bfloat16, False)])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 30, 131])
def test_small_linear(dtype: torch.dtype, float32_out: bool, rows: int) -> None:
    if not cpu_layer_ops.small_linear_dtype(dtype):
        pytest.skip(f"no {dtype} small_linear in this build")
    if rows > cpu_layer_ops.small_linear_max_rows():
        pytest.skip(f"this build takes at most {cpu_layer_ops.small_linear_max_rows()} rows")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96 + 5, generator=g).to(dtype)[:, :96]  # rows strided
    w = torch.randn(1001, 96, generator=g).to(dtype)  # an odd count: a group of one at the end
    assert cpu_layer_ops.small_linear_serves(x, w)
    out = cpu_layer_ops.small_linear(x, w, float32_out)
    ref = F.linear(x.float(), w.float())
    assert out.dtype == (torch.float32 if float32_out else dtype)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    else:  # rounded once from the float32 sum
        torch.testing.assert_close(out, ref.to(dtype), atol=0.0, rtol=1 / 128)


def test_bf16_without_onednn_bf16_through_small_linear() -> None:
    """Where oneDNN has no bf16 kernels (AVX2), bf16 weights take small_linear at every row
    count, and a wide-output weight (a bf16 model's logits) gives float32."""
    from common.models.ops_onednn import OneDnnLinear, onednn_bf16_available
    if onednn_bf16_available() or not cpu_layer_ops.bf16_dot_available():
        pytest.skip("oneDNN has bf16 kernels here, or small_linear has no bf16")
    g = torch.Generator().manual_seed(0)
    linear = OneDnnLinear()
    w, head = (torch.randn(n, 64, generator=g).bfloat16() for n in (96, 500))
    linear.wide_output(head)
    for rows in (1, 20, 300):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        ref = F.linear(x.float(), w.float())
        torch.testing.assert_close(linear(x, w), ref.bfloat16(), atol=0.0, rtol=1 / 128)
        out = linear(x, head)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, F.linear(x.float(), head.float()), atol=1e-4, rtol=1e-5)
    assert linear.num_packs == 0


def test_small_rows_through_onednn_linear() -> None:
    """OneDnnLinear takes a few rows through small_linear, more through oneDNN; a bf16 weight
    marked by wide_output (a bf16 model's logits, packed in float32) gives float32 either way."""
    from common.models.ops_onednn import OneDnnLinear, onednn_bf16_available
    if not (onednn_bf16_available() and cpu_layer_ops.bf16_dot_available()):
        pytest.skip("no bf16 oneDNN or kernel here")
    g = torch.Generator().manual_seed(0)
    linear = OneDnnLinear()
    for dtype, packed_dtype in ((torch.float32, None), (torch.bfloat16, None),
                                (torch.bfloat16, torch.float32)):
        w = torch.randn(500, 64, generator=g).to(dtype)
        if packed_dtype is not None:
            linear.wide_output(w)
        linear.pack(w, packed_dtype)
        want = packed_dtype or dtype
        for rows in (2, 20):
            x = torch.randn(rows, 64, generator=g).to(dtype)
            out = linear(x, w)
            assert out.dtype == want
            tol = {"atol": 1e-4, "rtol": 1e-5} if want == torch.float32 else {"atol": 0.0,
                                                                              "rtol": 1 / 64}
            torch.testing.assert_close(out, F.linear(x.float(), w.float()).to(want), **tol)


@pytest.mark.parametrize("n,k", [(960, 576), (480, 576), (100, 72)])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 40])
def test_packed_linear_reads_onednn_layout(n: int, k: int, rows: int) -> None:
    """packed_linear on oneDNN's packing of a float32 weight (padded where N is not a multiple
    of 64 or K of 16) gives F.linear's result."""
    from common.models.ops_onednn import onednn_available, packed_layout_view
    if not (onednn_available() and cpu_layer_ops.packed_linear_available()):
        pytest.skip("no oneDNN or packed_linear here")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(n, k, generator=g)
    view = packed_layout_view(torch.ops.mkldnn._reorder_linear_weight(w, 64), w)
    if view is None:
        pytest.skip("oneDNN lays float32 weights out otherwise on this CPU")
    x = torch.randn(rows, k + 3, generator=g)[:, :k]  # rows strided
    torch.testing.assert_close(cpu_layer_ops.packed_linear(x, view, n), F.linear(x, w),
                               atol=1e-4, rtol=1e-5)


def test_projection_held_packed_only() -> None:
    """A module whose weight install_cpu_ops holds packed only computes F.linear of the original
    weight at every row count, with and without its bias, and gives its values back."""
    from common.models.ops_onednn import OneDnnLinear, dense_weight, packed_only
    g = torch.Generator().manual_seed(0)
    for bias in (False, True):
        module = torch.nn.Linear(64, 200, bias=bias).requires_grad_(False)
        weight = module.weight.clone()
        linear = OneDnnLinear()
        if not linear.hold_packed_only(module):
            pytest.skip("oneDNN's layout is another here, or packed_linear is not built")
        assert module.weight.is_meta and packed_only(module.weight) is not None
        assert torch.equal(dense_weight(module.weight), weight)
        for rows in (1, 5, 16, 17, 100):
            x = torch.randn(rows, 64, generator=g)
            torch.testing.assert_close(linear(x, module.weight, module.bias),
                                       F.linear(x, weight, module.bias), atol=1e-4, rtol=1e-5)
