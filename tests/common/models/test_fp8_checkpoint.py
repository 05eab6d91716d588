"""FP8 checkpoints (common.models.fp8_checkpoint), written by common.models.fp8_export from
SmolLM2-135M and from a tiny random Llama:

- compressed-tensors (a scale per channel) loads to exactly the Fp8Weights --quantization fp8
  makes of the original; vLLM's fp8 (a scale per tensor) to each tensor's own quantization,
  its scale repeated over the tensor's rows in the fused q|k|v and gate|up;
- the engine gives HF transformers' greedy tokens on the dequantized weights (float32 on CPU):
  SmolLM2 with --quantization left at its default, against the online-fp8 test's HF model; the
  tiny model in both layouts with --quantization fp8 given (not quantized a second time), and
  at TP 2 on gloo ranks the tokens of TP 1 (SmolLM2's 9 heads do not split in 2);
- each rank of TP 2 and 4 (KV heads replicated) holds its rows of a column-parallel weight and
  their scales, or its columns of a row-parallel one and all its rows' scales;
- schemes that do not load, and checkpoints that do not match their scheme, fail by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.errors import ConfigError
from common.flags import build
from common.models.fp8 import Fp8Linear, Fp8Weight, is_quantized
from common.models.fp8_export import export_fp8
from common.models.llama import LlamaModel
from common.models.loader import load_model
from common.models.sharding import NO_SHARD, Shard
from kernels import torch_ops
from tests.common.models import test_fp8_vs_hf as online_fp8

# The online-fp8 test's fixtures, this module's too: SmolLM2 quantized at load (fp8_model), HF
# on the per-channel round trip of every projection (hf_dequantized), and the prompt.
fp8_model, hf_dequantized, prompt_ids = (online_fp8.fp8_model, online_fp8.hf_dequantized,
                                         online_fp8.prompt_ids)

CPU = torch.device("cpu")
PROJ = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
        "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}
NEW_TOKENS = 6  # a CPU decode step dequantizes every fp8 weight: ~0.4 s on SmolLM2
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def load(spec: Path | str, cache: Path, shard: Shard = NO_SHARD) -> LlamaModel:
    return load_model(str(spec), dtype=torch.float32, device=CPU, cache_dir=cache,
                      shard=shard)[0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def projections(model: LlamaModel):
    """(layer index, fused name, Fp8Linear) of every projection."""
    for i, layer in enumerate(model.layers):
        for path in PROJ:
            parent, name = path.split(".")
            yield i, path, getattr(getattr(layer, parent), name)


@pytest.fixture(scope="module")
def ct_dir(smollm2_dir, tmp_path_factory) -> Path:
    return export_fp8(smollm2_dir, tmp_path_factory.mktemp("ct") / "smollm2-fp8-ct")


@pytest.fixture(scope="module")
def f8_dir(smollm2_dir, tmp_path_factory) -> Path:
    return export_fp8(smollm2_dir, tmp_path_factory.mktemp("f8") / "smollm2-fp8", "fp8")


@pytest.fixture(scope="module")
def original(smollm2_dir) -> dict[str, torch.Tensor]:
    return load_file(str(smollm2_dir / "model.safetensors"))


# ---- (a) the loaded weights -----------------------------------------------------------------
def test_compressed_tensors_is_bit_for_bit_online_fp8(ct_dir, fp8_model, model_cache_dir):
    online = fp8_model
    ours = load(ct_dir, model_cache_dir)
    assert is_quantized(ours)
    with safe_open(str(ct_dir / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight_scale").shape == (1536, 1)
    for (i, path, got), (_, _, want) in zip(projections(ours), projections(online), strict=True):
        assert isinstance(got, Fp8Linear) and isinstance(got.weight, Fp8Weight)
        assert torch.equal(bits(got.qweight), bits(want.qweight)), (i, path)
        assert torch.equal(got.weight_scale, want.weight_scale), (i, path)
    assert torch.equal(ours.embed_tokens.weight, online.embed_tokens.weight)
    assert torch.equal(ours.layers[7].input_layernorm.weight,
                       online.layers[7].input_layernorm.weight)


def test_fp8_per_tensor_scales_become_per_row(f8_dir, original, model_cache_dir):
    ours = load(f8_dir, model_cache_dir)
    for i, path, got in projections(ours):
        if i not in (0, 14, 29):
            continue
        qs, scales = [], []
        for name in PROJ[path]:
            w = original[f"model.layers.{i}.{path.split('.')[0]}.{name}.weight"]
            q, scale = torch_ops.quantize_rows(w.reshape(1, -1))  # one scale: amax of w / 448
            qs.append(q.view(w.shape))
            scales.append(scale.reshape(1).expand(w.shape[0]))
        assert torch.equal(bits(got.qweight), bits(torch.cat(qs))), (i, path)
        assert torch.equal(got.weight_scale, torch.cat(scales)), (i, path)
    assert len(set(ours.layers[0].self_attn.qkv_proj.weight_scale.tolist())) == 3  # q, k, v


# ---- (b) SmolLM2's greedy tokens against HF -------------------------------------------------
def engine(model_dir: Path, cache: Path, **kw) -> LLMEngine:
    return LLMEngine(build(EngineConfig, model=str(model_dir), model_cache_dir=str(cache),
                           num_kv_blocks=64, **kw))


def greedy(eng: LLMEngine, prompt: list[int]) -> list[int]:
    return eng.generate([prompt], GREEDY)[0].output_token_ids


def hf_choices(hf, prompt: list[int], tokens: list[int]) -> list[int]:
    """HF's greedy token after the prompt and after each prefix of tokens, from one forward:
    equal to tokens exactly when HF's greedy decoding of the prompt gives tokens."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1:-1].argmax(-1).tolist()


@pytest.fixture(scope="module")
def ct_tokens(ct_dir, model_cache_dir, prompt_ids) -> list[int]:
    eng = engine(ct_dir, model_cache_dir)  # --quantization left at its default
    assert isinstance(eng.model.layers[5].mlp.gate_up_proj, Fp8Linear)
    return greedy(eng, prompt_ids)


def test_engine_on_compressed_tensors_matches_hf(ct_tokens, hf_dequantized, prompt_ids):
    assert len(ct_tokens) == NEW_TOKENS
    assert hf_choices(hf_dequantized, prompt_ids, ct_tokens) == ct_tokens


# ---- (b, c) a tiny Llama: HF's tokens, TP 2's, each rank's slices ---------------------------
@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """A tiny random Llama (4 heads, 2 KV heads, MLP 96, SmolLM2's tokenizer and vocabulary)
    and its two FP8 exports. Weights large enough that greedy choices are not near ties."""
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                      max_position_embeddings=256)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.3 * torch.randn_like(p))
    hf.save_pretrained(root / "bf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, root / "bf" / name)
    return {"bf": root / "bf",
            "compressed-tensors": export_fp8(root / "bf", root / "ct", "compressed-tensors"),
            "fp8": export_fp8(root / "bf", root / "f8", "fp8")}


def hf_on_checkpoint(original: Path, fp8_dir: Path):
    """HF's model of original with each projection's weights those of the fp8 checkpoint,
    dequantized (float32)."""
    hf = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    with torch.no_grad(), safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name, p in hf.named_parameters():
            if name + "_scale" in names:
                scale = f.get_tensor(name + "_scale").reshape(-1).expand(p.shape[0])
                p.copy_(torch_ops.dequantize_rows(f.get_tensor(name), scale, torch.float32))
    return hf


TINY_PROMPT = [(i * 997 + 13) % 49000 + 100 for i in range(40)]


@pytest.fixture(scope="module")
def tiny_tokens(tiny_dirs, model_cache_dir) -> dict[str, list[int]]:
    """Greedy tokens of the engine at TP 1 on each tiny export, --quantization fp8 given
    (a checkpoint already in fp8 is not quantized again)."""
    out = {}
    for fmt in ("compressed-tensors", "fp8"):
        eng = engine(tiny_dirs[fmt], model_cache_dir, quantization="fp8")
        assert isinstance(eng.model.layers[1].mlp.down_proj, Fp8Linear)
        out[fmt] = greedy(eng, TINY_PROMPT)
    return out


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_engine_on_tiny_checkpoint_matches_hf(fmt, tiny_dirs, tiny_tokens):
    hf = hf_on_checkpoint(tiny_dirs["bf"], tiny_dirs[fmt])
    assert hf_choices(hf, TINY_PROMPT, tiny_tokens[fmt]) == tiny_tokens[fmt]


def test_tp2_engine_gives_tp1_tokens(tiny_dirs, tiny_tokens, model_cache_dir):
    """Per-channel scales, so that a rank given another's rows' scales would show."""
    eng = engine(tiny_dirs["compressed-tensors"], model_cache_dir, tensor_parallel_size=2)
    try:
        assert greedy(eng, TINY_PROMPT) == tiny_tokens["compressed-tensors"]
    finally:
        eng.close()


@pytest.mark.parametrize(("fmt", "size"), [
    ("compressed-tensors", 2), ("fp8", 2),
    ("compressed-tensors", 4),  # each KV head on two ranks
    ("fp8", 4),
])
def test_each_rank_holds_its_rows_or_columns_and_their_scales(fmt, size, tiny_dirs,
                                                               model_cache_dir):
    model_dir = tiny_dirs[fmt]
    whole = load(model_dir, model_cache_dir).hf_weight_targets()
    for rank in range(size):
        part = load(model_dir, model_cache_dir, Shard(rank, size))
        for name, t in part.hf_weight_targets().items():
            if not isinstance(t.param, Fp8Weight):
                continue
            w = whole[name]
            n = t.end - t.start if t.src_dim == 0 else t.param.qweight.shape[1]
            full_q = w.param.qweight[w.start:w.end]
            full_scale = w.param.scale[w.start:w.end]
            assert torch.equal(bits(t.param.qweight[t.start:t.end]),
                               bits(full_q.narrow(t.src_dim, t.src_start, n))), (rank, name)
            want_scale = full_scale.narrow(0, t.src_start, n) if t.src_dim == 0 else full_scale
            assert torch.equal(t.param.scale[t.start:t.end], want_scale), (rank, name)


# ---- (d) what does not load -----------------------------------------------------------------
def _variant(src: Path, dst: Path, *, config: dict | None = None,
             edit=None) -> Path:
    """A copy of checkpoint src with config.json's quantization_config replaced by config
    (None: removed, ... : kept) and its tensors passed through edit."""
    shutil.copytree(src, dst)
    hf = json.loads((src / "config.json").read_text())
    if config is None:
        hf.pop("quantization_config")
    elif config is not ...:
        hf["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(hf))
    if edit is not None:
        tensors = load_file(str(src / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _ct(weights: dict, activations: dict | None = None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", **weights},
             "input_activations": activations}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, **extra}


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     r"fp8 checkpoint with block-wise weight scales \(weight_block_size \[128, 128\]\) is not "
     "supported"),
    (_ct({"strategy": "block", "block_structure": [128, 128]}),
     "compressed-tensors checkpoint with group_0: block-wise scales is not supported"),
    (_ct({"strategy": "group", "group_size": 128}), "weight strategy 'group' is not supported"),
    (_ct({"strategy": "channel", "type": "int"}), "group_0: 8-bit int weights is not supported"),
    (_ct({"strategy": "channel", "type": "int", "num_bits": 4}, format="pack-quantized"),
     "format 'pack-quantized' is not supported"),
    (_ct({"strategy": "channel"}, {"num_bits": 8, "type": "int", "dynamic": True}),
     "8-bit int input activations is not supported"),
    (_ct({"strategy": "channel", "symmetric": False}), "asymmetric weights is not supported"),
    (_ct({"strategy": "channel"}, kv_cache_scheme={"num_bits": 8, "type": "float"}),
     "kv_cache_scheme"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
])
def test_unsupported_schemes_are_named(config, message, tiny_dirs, tmp_path, model_cache_dir):
    d = _variant(tiny_dirs["compressed-tensors"], tmp_path / "bad", config=config)
    with pytest.raises(ConfigError, match=message):
        load(d, model_cache_dir)


def _drop_scale(t):
    del t["model.layers.1.self_attn.k_proj.weight_scale"]


def _full_precision_down(t):
    t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].float()


def _block_scales(t):
    t["model.layers.0.self_attn.o_proj.weight_scale"] = torch.ones(32, 32)


def _tensor_scale(t):
    t["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(1)


@pytest.mark.parametrize(("edit", "config", "message"), [
    (_drop_scale, ..., r"lacks 1 tensor\(s\): \['model.layers.1.self_attn.k_proj.weight_scale'"),
    (_full_precision_down, ..., "model.layers.0.mlp.down_proj.weight is F32, expected "
                                "float8_e4m3fn"),
    (_block_scales, ..., r"o_proj.weight_scale has shape \(32, 32\): expected \[64, 1\].*"
                         "block-wise scales are not supported"),
    (_tensor_scale, ..., "up_proj.weight_scale is a per-tensor scale, but the compressed-tensors "
                         "config declares channel"),
    (None, None, r"\.weight is F8_E4M3 \(fp8\), but config.json declares no "
                 "quantization_config"),
])
def test_checkpoints_that_do_not_match_their_scheme_fail(edit, config, message, tiny_dirs,
                                                         tmp_path, model_cache_dir):
    d = _variant(tiny_dirs["compressed-tensors"], tmp_path / "bad", config=config, edit=edit)
    with pytest.raises(ValueError, match=message):
        load(d, model_cache_dir)


def test_static_input_scales_are_read_past(tiny_dirs, tmp_path, model_cache_dir):
    def add_input_scales(t):
        for name in [n for n in t if n.endswith(".weight_scale")]:
            t[name.replace(".weight_scale", ".input_scale")] = torch.tensor(0.05)

    static = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    d = _variant(tiny_dirs["compressed-tensors"], tmp_path / "static",
                 config=_ct({"strategy": "channel"}, static), edit=add_input_scales)
    got, want = load(d, model_cache_dir), load(tiny_dirs["compressed-tensors"], model_cache_dir)
    for (_, _, a), (_, _, b) in zip(projections(got), projections(want), strict=True):
        assert torch.equal(bits(a.qweight), bits(b.qweight))
        assert torch.equal(a.weight_scale, b.weight_scale)


def test_compressed_tensors_per_tensor_scales_load_as_fp8s(tiny_dirs, tmp_path, model_cache_dir):
    """The fp8 export's [] scales as [1], under a compressed-tensors tensor strategy."""
    def as_one_element(t):
        for name in [n for n in t if n.endswith(".weight_scale")]:
            t[name] = t[name].reshape(1)

    d = _variant(tiny_dirs["fp8"], tmp_path / "ct-tensor", config=_ct({"strategy": "tensor"}),
                 edit=as_one_element)
    got, want = load(d, model_cache_dir), load(tiny_dirs["fp8"], model_cache_dir)
    for (_, _, a), (_, _, b) in zip(projections(got), projections(want), strict=True):
        assert torch.equal(bits(a.qweight), bits(b.qweight))
        assert torch.equal(a.weight_scale, b.weight_scale)
