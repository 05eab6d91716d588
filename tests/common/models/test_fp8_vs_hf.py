"""FP8 on CPU (float32 compute), SmolLM2-135M against HF transformers on the dequantized weights.

- Weights (--quantization fp8): the CPU path dequantizes each fp8 weight to float32 (qweight *
  scale) and multiplies as before, so it is exactly the model whose weights are the dequantized
  ones: HF on those weights gives the same logits (to float32 summation order: 0 here) and the
  same greedy tokens, through the paged runner and through LLMEngine.
- Activations quantized per token as well (W8A8, what torch._scaled_mm computes on the GPU;
  emulated by kernels.torch_ops.fp8_linear): no longer the same model. e4m3 keeps 3 mantissa
  bits, so each quantized activation is off by up to 1/16 of its value (~3.6% rms); through 30
  layers and 120 projections SmolLM2's logits measured 11.5% median relative error and 92.5%
  top-1 agreement over the prompt's positions (2026-12-02). Bounds: median <= 0.2, top-1 >= 0.85.
- KV cache in e4m3 (--kv-cache-dtype fp8, scale 1.0) with exact weights: each stored K/V value
  is off by up to 1/16 of itself (its |max| here is ~15, far inside +-448, so nothing
  saturates); measured 6.0% median relative logit error and 100% top-1 agreement. Bounds:
  median <= 0.1, top-1 >= 0.9. The engine with an fp8 pool gives exactly the paged runner's
  tokens with an fp8 pool (the same arithmetic in another path).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from common.models import ops as model_ops
from common.models.fp8 import Fp8Linear, Fp8Weight, quantize_model
from common.models.llama import LlamaModel
from common.models.loader import load_model
from kernels import torch_ops

PROMPT = ("The city of Paris is the capital of France. It is known for the Eiffel Tower, "
          "the Louvre museum, and its small cafes on quiet streets. Many tourists visit every "
          "single year because")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def fp8_model(smollm2_dir: Path, model_cache_dir: Path) -> LlamaModel:
    model, _ = load_model(str(smollm2_dir), dtype=torch.float32, device=torch.device("cpu"),
                          cache_dir=model_cache_dir)
    quantize_model(model)
    return model


@pytest.fixture(scope="module")
def hf_dequantized(smollm2_dir: Path):
    """HF's model with every projection weight replaced by its fp8 round trip."""
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                         mlp.up_proj, mlp.down_proj):
                q, scale = torch_ops.quantize_rows(proj.weight)
                proj.weight.copy_(torch_ops.dequantize_rows(q, scale, torch.float32))
    return hf


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(smollm2_dir)(PROMPT, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def hf_logits(hf_dequantized, prompt_ids) -> torch.Tensor:
    with torch.inference_mode():
        return hf_dequantized(torch.tensor([prompt_ids])).logits[0].float()


@pytest.fixture(scope="module")
def hf_tokens(hf_dequantized, prompt_ids) -> list[int]:
    with torch.inference_mode():
        out = hf_dequantized.generate(torch.tensor([prompt_ids]), do_sample=False,
                                      max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      pad_token_id=hf_dequantized.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def _greedy(runner, prompt_ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits and n greedy tokens through a PagedRunner."""
    (logits,) = runner.step([(0, prompt_ids)])
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < n:
        (step,) = runner.step([(0, tokens[-1:])])
        tokens.append(int(step[-1].argmax()))
    return logits, tokens


def _rel(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each position's logits."""
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1)


def test_quantized_layout(fp8_model: LlamaModel) -> None:
    layer = fp8_model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):
        assert isinstance(proj, Fp8Linear) and isinstance(proj.weight, Fp8Weight)
        assert proj.qweight.dtype == torch.float8_e4m3fn
        assert proj.weight_scale.shape == (proj.out_features,)
    assert fp8_model.embed_tokens.weight.dtype == torch.float32  # logits weight (tied) untouched


def test_weights_only_is_exactly_the_dequantized_model(fp8_model, hf_logits, hf_tokens,
                                                       prompt_ids, paged_runner) -> None:
    logits, tokens = _greedy(paged_runner(fp8_model), prompt_ids, NEW_TOKENS)
    assert (logits - hf_logits).abs().max().item() < 1e-4
    assert tokens == hf_tokens


def test_engine_fp8_weights_match_hf(model_cache_dir, hf_tokens, prompt_ids) -> None:
    engine = LLMEngine(build(EngineConfig, model="SmolLM2-135M-Instruct",
                             model_cache_dir=str(model_cache_dir), num_kv_blocks=64,
                             quantization="fp8"))
    assert isinstance(engine.model.layers[3].mlp.down_proj, Fp8Linear)
    (out,) = engine.generate([prompt_ids], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                           ignore_eos=True))
    assert out.output_token_ids == hf_tokens


def _w8a8(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, Fp8Weight):
        return torch_ops.fp8_linear(x, weight.qweight, weight.scale, bias)
    return torch.nn.functional.linear(x, weight, bias)


def test_activations_quantized_within_bounds(fp8_model, hf_logits, prompt_ids,
                                             paged_runner) -> None:
    ops = model_ops
    norm_linear = ops.compose_norm_linear(torch_ops.rms_norm, _w8a8)
    w8a8_ops = dataclasses.replace(
        ops.REFERENCE_OPS, linear=_w8a8, norm_linear=norm_linear,
        act_linear=ops.compose_act_linear(torch_ops.silu_and_mul, _w8a8),
        norm_qkv_rotary_store=ops.compose_norm_qkv_rotary_store(norm_linear,
                                                                ops.reference_rotary_store))
    fp8_model.ops = w8a8_ops
    try:
        (logits,) = paged_runner(fp8_model).step([(0, prompt_ids)])
    finally:
        fp8_model.ops = ops.REFERENCE_OPS
    rel = _rel(logits, hf_logits)
    assert rel.median().item() <= 0.2
    assert (logits.argmax(-1) == hf_logits.argmax(-1)).float().mean().item() >= 0.85
    assert rel.median().item() > 1e-3  # the activations were quantized: not the same model


def test_fp8_kv_cache_within_bounds(fp8_model, hf_logits, prompt_ids, model_cache_dir,
                                    paged_runner) -> None:
    runner = paged_runner(fp8_model)
    runner.kv_cache = runner.kv_cache.to(torch.float8_e4m3fn)
    logits, tokens = _greedy(runner, prompt_ids, NEW_TOKENS)
    rel = _rel(logits, hf_logits)
    assert 1e-3 < rel.median().item() <= 0.1
    assert (logits.argmax(-1) == hf_logits.argmax(-1)).float().mean().item() >= 0.9
    assert runner.kv_cache.float().abs().max().item() < 448  # nothing saturated

    engine = LLMEngine(build(EngineConfig, model="SmolLM2-135M-Instruct",
                             model_cache_dir=str(model_cache_dir), num_kv_blocks=64,
                             quantization="fp8", kv_cache_dtype="fp8"))
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert engine.runner.bytes_per_block * 4 == (
        2 * 30 * 16 * 3 * 64 * 4)  # a quarter of float32's: 1 byte an element
    (out,) = engine.generate([prompt_ids], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                           ignore_eos=True))
    assert out.output_token_ids == tokens
