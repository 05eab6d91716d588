"""The rotary-embedding table: cos/sin of every position, with optional Llama-3 frequency
scaling, in the layout kernels.torch_ops.apply_rotary reads."""

from __future__ import annotations

import math

import torch

from common.models.model_config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, Llama-3 scaled if configured.

    Llama-3 scaling keeps high frequencies (wavelength < original_ctx / high_freq_factor),
    divides low ones (wavelength > original_ctx / low_freq_factor) by `factor`, and blends
    linearly in between.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s is None:
        return inv
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def cos_sin_cache(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """[max_position_embeddings, head_dim] float32: cos(p * f) | sin(p * f)."""
    inv = inv_frequencies(config).to(device)
    pos = torch.arange(config.max_position_embeddings, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
