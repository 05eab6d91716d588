"""`dummy:<shape>` models: real architectures with seeded random weights, for benchmarks and
fast tests without a checkpoint. They have no tokenizer; callers feed token ids directly."""

from __future__ import annotations

import torch
from torch import nn

from common.models.model_config import ModelConfig


def _shape(name: str, *, layers: int, hidden: int, inter: int, heads: int, kv_heads: int,
           vocab: int, max_pos: int, theta: float, eps: float, tied: bool,
           arch: str = "llama", head_dim: int | None = None,
           rope_scaling: dict | None = None, bos: int | None = 1,
           eos: tuple[int, ...] = (2,)) -> ModelConfig:
    return ModelConfig(
        name=f"dummy:{name}", architecture=arch, path="", num_layers=layers, hidden_size=hidden,
        intermediate_size=inter, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim or hidden // heads, vocab_size=vocab, max_position_embeddings=max_pos,
        rms_norm_eps=eps, rope_theta=theta, rope_scaling=rope_scaling, tie_word_embeddings=tied,
        attention_bias=arch == "qwen2", bos_token_id=bos, eos_token_ids=eos)


DUMMY_CONFIGS: dict[str, ModelConfig] = {
    "tiny-llama": _shape("tiny-llama", layers=2, hidden=64, inter=128, heads=4, kv_heads=2,
                         vocab=512, max_pos=2048, theta=10000.0, eps=1e-5, tied=False),
    "smollm2-135m": _shape("smollm2-135m", layers=30, hidden=576, inter=1536, heads=9,
                           kv_heads=3, vocab=49152, max_pos=8192, theta=100000.0, eps=1e-5,
                           tied=True),
    "llama-3.2-1b": _shape("llama-3.2-1b", layers=16, hidden=2048, inter=8192, heads=32,
                           kv_heads=8, vocab=128256, max_pos=131072, theta=500000.0, eps=1e-5,
                           tied=True, bos=128000, eos=(128001, 128008, 128009),
                           rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}),
    "llama-3-8b": _shape("llama-3-8b", layers=32, hidden=4096, inter=14336, heads=32,
                         kv_heads=8, vocab=128256, max_pos=8192, theta=500000.0, eps=1e-5,
                         tied=False, bos=128000, eos=(128001, 128009)),
    "qwen2.5-0.5b": _shape("qwen2.5-0.5b", arch="qwen2", layers=24, hidden=896, inter=4864,
                           heads=14, kv_heads=2, vocab=151936, max_pos=32768, theta=1000000.0,
                           eps=1e-6, tied=True, bos=None, eos=(151645, 151643)),
    # Small draft models for speculative decoding tests: SmolLM2's vocabulary (a draft for it),
    # and a 32-token vocabulary with a target and a smaller draft (distribution tests).
    "smollm2-draft-tiny": _shape("smollm2-draft-tiny", layers=2, hidden=64, inter=128, heads=4,
                                 kv_heads=2, vocab=49152, max_pos=8192, theta=100000.0,
                                 eps=1e-5, tied=True),
    "vocab32": _shape("vocab32", layers=2, hidden=64, inter=128, heads=4, kv_heads=2, vocab=32,
                      max_pos=1024, theta=10000.0, eps=1e-5, tied=False),
    "vocab32-draft": _shape("vocab32-draft", layers=1, hidden=32, inter=64, heads=2, kv_heads=1,
                            vocab=32, max_pos=1024, theta=10000.0, eps=1e-5, tied=False),
}


def dummy_config(shape: str) -> ModelConfig:
    if shape not in DUMMY_CONFIGS:
        raise ValueError(f"unknown dummy shape {shape!r}; known: {', '.join(DUMMY_CONFIGS)}")
    return DUMMY_CONFIGS[shape]


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Norm weights = 1, everything else ~ N(0, std), drawn from a seeded generator on the
    parameters' own device (same seed and device -> same weights)."""
    params = list(model.named_parameters())
    if not params or params[0][1].device.type == "meta":
        return
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    with torch.no_grad():
        for name, p in params:
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)


def init_dummy_shard(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """init_dummy_weights for a tensor-parallel rank: this rank's slices of exactly the weights
    init_dummy_weights gives the whole model (the full tensors are drawn one at a time, in the
    same order, from the same generator, and each sliced as a checkpoint's would be)."""
    from common.models.llama import LlamaModel
    from common.models.weights import copy_shard

    device = next(model.parameters()).device
    full = LlamaModel(model.config, dtype=next(model.parameters()).dtype,
                      device=torch.device("meta"))
    by_param: dict[int, list[str]] = {}
    for name, t in full.hf_weight_targets().items():
        by_param.setdefault(id(t.param), []).append(name)
    full_targets, targets = full.hf_weight_targets(), model.hf_weight_targets()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in full.named_parameters():
            drawn = torch.empty(p.shape, dtype=p.dtype, device=device)
            if name.endswith("norm.weight"):
                drawn.fill_(1.0)
            else:
                drawn.normal_(0.0, std, generator=gen)
            for hf_name in by_param[id(p)]:
                src = full_targets[hf_name]
                copy_shard(targets[hf_name], drawn[src.start:src.end])
