"""OneDnnLinear against F.linear, its fall-backs and packing count, and the engine's greedy tokens
with cpu_linear onednn against torch on the real model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from common.models.ops import REFERENCE_OPS
from common.models.ops_onednn import (
    OneDnnLinear,
    dense_weight,
    install_cpu_ops,
    onednn_available,
    onednn_bf16_available,
    onednn_ops,
    pack_dtype,
    packable,
    packed_layout_view,
    packed_only,
    resolve_cpu_linear,
)
from kernels import cpu_layer_ops

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="no usable oneDNN")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 7, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(192, 576, generator=g)
    bias = torch.randn(192, generator=g) if with_bias else None
    x = torch.randn(rows, 576, generator=g)
    linear = OneDnnLinear()
    _close(linear(x, weight, bias), F.linear(x, weight, bias))
    # packed at the first call that oneDNN runs (small_linear reads the original)
    small = bias is None and cpu_layer_ops.small_linear_serves(x, weight, linear.small_rows(weight))
    assert linear.num_packs == (0 if small else 1)


@needs_onednn
def test_leading_dims_and_non_contiguous_input() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 96, generator=g)
    x3 = torch.randn(2, 5, 96, generator=g)
    xt = torch.randn(96, 7, generator=g).t()
    linear = OneDnnLinear()
    _close(linear(x3, weight, None), F.linear(x3, weight))
    _close(linear(xt, weight, None), F.linear(xt, weight))


@needs_onednn
def test_tied_embedding_weight() -> None:
    emb = torch.nn.Embedding(1000, 64)
    emb.requires_grad_(False)
    hidden = torch.randn(20, 64, generator=torch.Generator().manual_seed(2))  # oneDNN's rows
    linear = OneDnnLinear()
    with torch.inference_mode():
        _close(linear(hidden, emb.weight, None), F.linear(hidden, emb.weight))
        ids = torch.tensor([0, 5, 999])
        assert torch.equal(F.embedding(ids, emb.weight), emb.weight[ids])  # the table unchanged
    assert linear.num_packs == 1


@needs_onednn
def test_packs_each_weight_once() -> None:
    a, b = torch.randn(32, 16), torch.randn(48, 16)
    linear = OneDnnLinear()
    for rows in (1, 3, 64, 2):
        linear(torch.randn(rows, 16), a, None)
        linear(torch.randn(rows, 16), b, None)
    assert linear.num_packs == 2


@needs_onednn
def test_repacks_a_weight_modified_in_place() -> None:
    weight = torch.randn(32, 16)
    x = torch.randn(3, 16)
    linear = OneDnnLinear()
    linear(x, weight, None)
    weight.mul_(2.0)
    _close(linear(x, weight, None), F.linear(x, weight))
    assert linear.num_packs == 2


@pytest.mark.parametrize("case", ["float16", "requires_grad", "float64"])
def test_falls_back_to_f_linear(case: str) -> None:
    g = torch.Generator().manual_seed(3)
    weight, x, bias = torch.randn(32, 16, generator=g), torch.randn(3, 16, generator=g), None
    if case == "float16":
        weight, x = weight.half(), x.half()
    elif case == "requires_grad":
        weight.requires_grad_(True)
    else:
        weight, x, bias = weight.double(), x.double(), torch.randn(32, generator=g).double()
    linear = OneDnnLinear()
    out = linear(x, weight, bias)
    assert torch.equal(out, F.linear(x, weight, bias))
    assert linear.num_packs == 0
    if case == "requires_grad":
        out.sum().backward()
        assert weight.grad is not None
        torch.testing.assert_close(weight.grad, x.sum(0).expand(32, 16))


needs_bf16 = pytest.mark.skipif(not packable(torch.ones(2, 2, dtype=torch.bfloat16)),
                                reason="bf16 weights are not packed here")


def test_native_bf16_follows_the_cpu() -> None:
    """torch says bf16 on any AVX-512 CPU; oneDNN's bf16 counts as native only with AVX-512
    BF16 or AMX (the CPU's flags, as /proc/cpuinfo lists them), else a bf16 weight is packed in
    float32 (or left to small_linear on AVX2)."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    flags = next((line.split() for line in lines if line.startswith("flags")), None)
    if not (onednn_available() and flags and "avx2" in flags):
        pytest.skip("no oneDNN, or not an x86 CPU whose flags are known")
    native = bool({"avx512_bf16", "amx_bf16"} & set(flags))
    assert onednn_bf16_available() == (native and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    want = (torch.bfloat16 if onednn_bf16_available()
            else None if cpu_layer_ops.bf16_dot_available() else torch.float32)
    assert pack_dtype(torch.ones(2, 2, dtype=torch.bfloat16)) == want
    assert pack_dtype(torch.ones(2, 2)) == torch.float32


@needs_bf16
@pytest.mark.parametrize("rows", [1, 32])
def test_bf16_matches_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(192, 576, generator=g).bfloat16()
    bias = torch.randn(192, generator=g).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    linear = OneDnnLinear()
    got, want = linear(x, weight, bias), F.linear(x.float(), weight.float(), bias.float())
    assert got.dtype == torch.bfloat16 and linear.num_packs == 1
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    if pack_dtype(weight) == torch.float32:  # float32 sums of exact products, rounded once
        torch.testing.assert_close(got, want.bfloat16(), atol=0.0, rtol=1 / 128)


@pytest.mark.skipif(pack_dtype(torch.ones(2, 2, dtype=torch.bfloat16)) != torch.float32,
                    reason="bf16 weights are not packed in float32 here")
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_held_packed_only_in_float32(with_bias: bool) -> None:
    """Without native bf16 a bf16 projection is held once, as its float32 packed copy: bf16
    rows in, bf16 out (float32 sums, rounded once), its dense weight the bf16 original."""
    g = torch.Generator().manual_seed(5)
    module = torch.nn.Linear(576, 192, bias=with_bias, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        module.weight.copy_(torch.randn(192, 576, generator=g))
    original = module.weight.clone()
    linear = OneDnnLinear()
    if not linear.hold_packed_only(module):
        pytest.skip("packed_linear does not read oneDNN's layout here")
    assert module.weight.is_meta and module.weight.dtype == torch.bfloat16
    assert torch.equal(dense_weight(module.weight), original)
    for rows in (1, 2, 7, 64):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        got = linear(x, module.weight, module.bias)
        want = F.linear(x.float(), original.float(),
                        None if module.bias is None else module.bias.float())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want.bfloat16(), atol=0.0, rtol=1 / 128)


@needs_bf16
def test_bf16_weight_marked_wide_gives_float32() -> None:
    """A bf16 model's logits weight (wide_output, packed in float32) gives float32 logits."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(100, 64, generator=g).bfloat16()
    x = torch.randn(5, 64, generator=g).bfloat16()
    linear = OneDnnLinear()
    linear.wide_output(weight)
    linear.pack(weight, torch.float32)
    _close(linear(x, weight, None), F.linear(x.float(), weight.float()))


def test_resolve_cpu_linear() -> None:
    assert resolve_cpu_linear("torch") == "torch"
    assert resolve_cpu_linear("auto") == ("onednn" if onednn_available() else "torch")
    with pytest.raises(ValueError, match="cpu_linear"):
        build(EngineConfig, cpu_linear="mkl")


@pytest.fixture(scope="module")
def engine_factory(model_cache_dir):
    def make(**kw) -> LLMEngine:
        return LLMEngine(build(EngineConfig, model="SmolLM2-135M-Instruct",
                                      model_cache_dir=str(model_cache_dir), num_kv_blocks=256,
                                      **kw))
    return make


@needs_onednn
def test_install_packs_linears_and_tied_head(engine_factory) -> None:
    engine = engine_factory(cpu_linear="onednn")
    model = engine.model
    linear = model.ops.linear
    assert isinstance(linear, OneDnnLinear)
    # qkv, o, gate|up and down per layer, and the tied embedding for the logits
    assert model.lm_head is None
    assert linear.num_packs == 4 * model.config.num_layers + 1
    # float32 projections held as their packed copies only (stand-ins on the meta device whose
    # values dense_weight gives); the logits weight stays beside its packed copy
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    held = packed_layout_view(torch.ops.mkldnn._reorder_linear_weight(torch.ones(64, 64), 64),
                              torch.ones(64, 64)) is not None
    originals = [dense_weight(m.weight).clone() for m in layers]
    assert all((packed_only(m.weight) is not None) == held for m in layers)
    assert all(m.weight.is_meta == held for m in layers)
    assert model.logits_weight.untyped_storage().nbytes() > 0
    install_cpu_ops(model, "onednn")  # a second runner on the same model keeps the packs
    assert model.ops.linear is linear
    install_cpu_ops(model, "torch")  # the dense weights back, equal to the originals
    assert model.ops is REFERENCE_OPS
    assert all(torch.equal(m.weight, w) for m, w in zip(layers, originals, strict=True))
    install_cpu_ops(model, "onednn")
    assert model.ops.linear is not linear
    assert all(torch.equal(dense_weight(m.weight), w)
               for m, w in zip(layers, originals, strict=True))


class _RecordingLinear(OneDnnLinear):
    def __init__(self) -> None:
        super().__init__()
        self.served: set[int] = set()  # ids of the weights it ran through oneDNN

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.serves(x, weight, bias):
            self.served.add(id(weight))
        return super().__call__(x, weight, bias)


@needs_onednn
def test_every_projection_and_the_logits_go_through_onednn(engine_factory) -> None:
    engine = engine_factory(cpu_linear="onednn")
    model = engine.model
    linear = _RecordingLinear()
    model.ops = onednn_ops(linear)
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0))
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linear.served == {id(w) for w in [*weights, model.logits_weight]}
    assert len(weights) == 4 * model.config.num_layers


@needs_onednn
def test_engine_greedy_tokens_equal_torch(engine_factory) -> None:
    engines = {name: engine_factory(cpu_linear=name) for name in ("torch", "onednn")}
    assert engines["torch"].model.ops is REFERENCE_OPS
    tok = engines["torch"].tokenizer
    texts = ["The capital of France is", "Write a haiku about the sea.",
             "def fibonacci(n):", "List three prime numbers:", "Once upon a time"]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outs = {name: [o.output_token_ids for o in e.generate(prompts, params)]
            for name, e in engines.items()}
    assert [len(o) for o in outs["torch"]] == [48] * len(prompts)
    assert outs["onednn"] == outs["torch"]
