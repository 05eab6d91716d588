"""ModelConfig from HF config.json dictionaries (transformers 4 and 5 styles)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.models.model_config import ModelConfig

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "max_position_embeddings": 4096}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}


def parse(arch: str, gen: dict | None = None, **extra) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": [arch], **BASE, **extra}, name="m",
                                    path="/m", generation_config=gen)


def test_llama_defaults():
    c = parse("LlamaForCausalLM", eos_token_id=2, bos_token_id=1)
    assert (c.architecture, c.head_dim, c.num_kv_heads, c.rope_theta, c.rope_scaling,
            c.attention_bias, c.tie_word_embeddings, c.eos_token_ids, c.bos_token_id) == (
        "llama", 16, 2, 10000.0, None, False, False, (2,), 1)
    assert (c.q_size, c.kv_size) == (64, 32)


def test_rope_old_style_keys():
    c = parse("LlamaForCausalLM", rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3})
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == {"rope_type": "llama3", **LLAMA3}


def test_rope_transformers5_parameters():
    c = parse("LlamaForCausalLM",
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3})
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == {"rope_type": "llama3", **LLAMA3}
    c = parse("LlamaForCausalLM", rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    assert (c.rope_theta, c.rope_scaling) == (1e5, None)
    assert hash(c) == hash(parse("LlamaForCausalLM",
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e5}))


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'; supported: llama3"):
        parse("LlamaForCausalLM", rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_eos_ids_from_list_and_generation_config():
    c = parse("LlamaForCausalLM", {"eos_token_id": [128008, 128009]}, eos_token_id=[128001, 128008])
    assert c.eos_token_ids == (128001, 128008, 128009)


def test_qwen2_has_qkv_bias_and_ignores_disabled_sliding_window():
    c = parse("Qwen2ForCausalLM", sliding_window=1024, use_sliding_window=False)
    assert (c.architecture, c.attention_bias) == ("qwen2", True)


def test_mistral_sliding_window():
    assert parse("MistralForCausalLM", sliding_window=None).architecture == "llama"
    assert parse("MistralForCausalLM", sliding_window=4096).architecture == "llama"
    with pytest.raises(ValueError, match="MistralForCausalLM with sliding_window=1024 < "
                                         "max_position_embeddings=4096 is not supported"):
        parse("MistralForCausalLM", sliding_window=1024)


def test_unsupported_architecture():
    with pytest.raises(ValueError, match=r"model 'm': unsupported architecture \['Phi3ForCausalLM'\]"):
        parse("Phi3ForCausalLM")
    with pytest.raises(ValueError, match="unsupported architecture None"):
        ModelConfig.from_hf_dict(BASE, name="m", path="/m")


def test_invalid_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        parse("LlamaForCausalLM", num_key_value_heads=3)


def test_from_pretrained_reads_generation_config(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], **BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    c = ModelConfig.from_pretrained(tmp_path)
    assert (c.name, c.path, c.eos_token_ids) == (tmp_path.name, str(tmp_path), (2, 7))
