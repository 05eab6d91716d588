"""Tiny random HF Llama (Llama-3 rope scaling), Qwen2 (qkv bias, tied) and Mistral models,
saved with save_pretrained and loaded by our loader: logits must match HF's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from common.models.loader import load_model

DIMS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
CONFIGS = {
    # original context 32 < prompt length: high, medium and low frequencies all occur.
    "llama3-rope": lambda: LlamaConfig(**DIMS, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "qwen2": lambda: Qwen2Config(**DIMS, tie_word_embeddings=True, rope_theta=1000000.0),
    "mistral": lambda: MistralConfig(**DIMS, sliding_window=None, head_dim=32),
}


def _random_hf_model(name: str, out: Path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    # Large enough weights that attention is sharp (so rotary errors would show), random norms
    # and biases so that every tensor's mapping matters.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_hf(name: str, tmp_path: Path, paged_runner):
    hf = _random_hf_model(name, tmp_path / name)
    ours, config = load_model(str(tmp_path / name), dtype=torch.float32,
                              device=torch.device("cpu"), cache_dir=tmp_path)
    assert config.architecture == ("qwen2" if name == "qwen2" else "llama")
    assert config.attention_bias == (name == "qwen2")
    assert (config.rope_scaling is not None) == (name == "llama3-rope")
    ids = torch.randint(0, 300, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = paged_runner(ours, num_blocks=16, block_size=16)
    got = torch.cat([runner.step([(0, ids[:60])])[0], runner.step([(0, ids[60:97])])[0]]
                    + [runner.step([(0, [t])])[0] for t in ids[97:]])
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    assert want.abs().max().item() > 1.0  # a meaningful comparison, not two near-zero tensors
    assert (got - want).abs().max().item() < 1e-4
