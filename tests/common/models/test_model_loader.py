"""Model specs: GGUF conversion and its cache, HF directories (sharded too), dummy shapes, and
the errors for what we cannot load."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from common.models import gguf_convert
from common.models.dummy import DUMMY_CONFIGS
from common.models.loader import DEFAULT_MODEL, bundled_gguf, load_model, resolve_model

CPU = torch.device("cpu")


def _assert_complete_model_dir(model_dir: Path) -> None:
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in model_dir.iterdir()}
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())


@pytest.mark.slow
def test_gguf_conversion_creates_the_cache_once(tmp_path: Path, monkeypatch):
    cache = tmp_path / "cache"
    model_dir = resolve_model(DEFAULT_MODEL, cache)  # a real conversion, about 20 s
    assert model_dir == gguf_convert.gguf_cache_path(bundled_gguf(), cache)
    stem, key = model_dir.name.rsplit("-", 1)
    assert stem == "SmolLM2-135M-Instruct.Q4_1" and len(key) == 12
    assert int(key, 16) >= 0
    assert [p.name for p in (cache / "models").iterdir()] == [model_dir.name]  # no temp dir
    _assert_complete_model_dir(model_dir)

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "_write_model_dir", no_conversion)
    start = time.monotonic()
    assert resolve_model(DEFAULT_MODEL, cache) == model_dir
    assert resolve_model(str(bundled_gguf()), cache) == model_dir
    model, config = load_model(DEFAULT_MODEL, dtype=torch.float32, device=CPU, cache_dir=cache)
    assert time.monotonic() - start < 10
    assert config.name == DEFAULT_MODEL


def test_default_model_loads_from_the_cache(smollm2_dir: Path, model_cache_dir: Path,
                                            monkeypatch):
    _assert_complete_model_dir(smollm2_dir)

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "_write_model_dir", no_conversion)
    model, config = load_model(DEFAULT_MODEL, dtype=torch.bfloat16, device=CPU,
                               cache_dir=model_cache_dir)
    assert config.name == DEFAULT_MODEL
    assert config.path == str(smollm2_dir)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_failed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch):
    fake = tmp_path / "broken.gguf"
    fake.write_bytes(b"GGUF")

    def crash(gguf_file: Path, out: Path):
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(gguf_convert, "_write_model_dir", crash)
    with pytest.raises(RuntimeError, match="mid-conversion"):
        resolve_model(str(fake), tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


@pytest.mark.parametrize(("shape", "params"), [
    ("tiny-llama", 139_584),
    ("smollm2-135m", 134_515_008),
    ("qwen2.5-0.5b", 494_032_768),
    ("llama-3.2-1b", 1_235_814_400),  # tied embeddings counted once
    ("llama-3-8b", 8_030_261_248),
])
def test_dummy_shapes_have_the_real_parameter_counts(shape: str, params: int, tmp_path: Path):
    model, config = load_model(f"dummy:{shape}", dtype=torch.bfloat16,
                               device=torch.device("meta"), cache_dir=tmp_path)
    assert config is DUMMY_CONFIGS[shape]
    assert sum(p.numel() for p in model.parameters()) == params


def test_dummy_weights_are_seeded_and_scaled(tmp_path: Path):
    a, _ = load_model("dummy:tiny-llama", dtype=torch.float32, device=CPU, cache_dir=tmp_path)
    b, _ = load_model("dummy:tiny-llama", dtype=torch.float32, device=CPU, cache_dir=tmp_path)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa))
    std = a.layers[0].mlp.gate_up_proj.weight.std().item()
    assert 0.018 < std < 0.022


def test_unknown_dummy_shape(tmp_path: Path):
    with pytest.raises(ValueError, match=r"unknown dummy shape 'gpt-5'; known: tiny-llama"):
        load_model("dummy:gpt-5", dtype=torch.float32, device=CPU, cache_dir=tmp_path)


def test_sharded_checkpoint_loads(tmp_path: Path):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    ours, _ = load_model(str(tmp_path / "m"), dtype=torch.float32, device=CPU,
                         cache_dir=tmp_path)
    assert torch.equal(ours.layers[1].self_attn.qkv_proj.weight[64:96],
                       hf.model.layers[1].self_attn.k_proj.weight)
    assert torch.equal(ours.layers[0].mlp.gate_up_proj.weight[96:],
                       hf.model.layers[0].mlp.up_proj.weight)


def _write_dir(path: Path, config: dict, tensors: dict | None = None) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors or {"x": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def test_unsupported_architecture_is_named(tmp_path: Path):
    d = _write_dir(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]; "
                                         r"supported: LlamaForCausalLM, MistralForCausalLM, "
                                         r"Qwen2ForCausalLM"):
        load_model(str(d), dtype=torch.float32, device=CPU, cache_dir=tmp_path)


def test_missing_files_are_named(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"no config.json in model directory "
                                                f"{tmp_path / 'empty'}"):
        resolve_model(str(tmp_path / "empty"), tmp_path)
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"no \\*.safetensors files in model directory "
                                                f"{tmp_path / 'noweights'}"):
        resolve_model(str(tmp_path / "noweights"), tmp_path)
    with pytest.raises(FileNotFoundError, match="GGUF file .*nothere.gguf does not exist"):
        resolve_model(str(tmp_path / "nothere.gguf"), tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a directory, a .gguf file"):
        resolve_model(str(tmp_path / "nothere"), tmp_path)


def test_checkpoint_missing_or_extra_tensors(tmp_path: Path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 300}
    d = _write_dir(tmp_path / "partial", cfg, {"model.norm.weight": torch.ones(64)})
    with pytest.raises(ValueError, match=r"lacks 11 tensor\(s\): \[.lm_head.weight., "):
        load_model(str(d), dtype=torch.float32, device=CPU, cache_dir=tmp_path)
    d = _write_dir(tmp_path / "extra", cfg, {"model.layers.0.self_attn.o_proj.bias":
                                             torch.zeros(64)})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.o_proj"):
        load_model(str(d), dtype=torch.float32, device=CPU, cache_dir=tmp_path)
