"""The shape and hyper-parameters of a decoder model, read from a Hugging Face model directory.

Supported families share one computation (pre-norm decoder, GQA attention with rotary, SwiGLU
MLP) and differ only in details captured here: Llama 2/3 (optionally Llama-3 rope scaling),
SmolLM2, TinyLlama, Mistral (as Llama, without sliding window) and Qwen2/2.5 (bias on q/k/v).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF `architectures` entry -> our architecture name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
ROPE_SCALING_TYPES = ("llama3",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    architecture: str            # "llama" | "qwen2"
    path: str                    # model directory ("" for dummy models)
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # None (plain rotary) or {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict[str, Any] | None = field(hash=False)
    tie_word_embeddings: bool
    attention_bias: bool         # bias on the q/k/v projections (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.architecture not in ("llama", "qwen2"):
            raise ValueError(f"architecture must be 'llama' or 'qwen2', got {self.architecture!r}")
        for f in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in ROPE_SCALING_TYPES:
                raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: "
                                 f"{', '.join(ROPE_SCALING_TYPES)} (or none)")
            missing = [k for k in _LLAMA3_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"llama3 rope_scaling lacks {missing}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, model_dir: Path) -> ModelConfig:
        """Reads model_dir/config.json (and generation_config.json for extra EOS ids)."""
        model_dir = Path(model_dir)
        config_file = model_dir / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        hf = json.loads(config_file.read_text())
        gen_file = model_dir / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_hf_dict(hf, name=model_dir.name, path=str(model_dir),
                                generation_config=gen)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, name: str, path: str,
                     generation_config: dict[str, Any] | None = None) -> ModelConfig:
        archs = hf.get("architectures") or []
        supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ValueError(f"model {name!r}: unsupported architecture {archs or None}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        hf_arch = supported[0]
        arch = SUPPORTED_ARCHITECTURES[hf_arch]
        max_pos = int(hf.get("max_position_embeddings", 2048))
        _check_no_sliding_window(hf, hf_arch, max_pos)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model {name!r}: hidden_act {hf['hidden_act']!r} is not supported "
                             "(only silu)")
        if hf.get("mlp_bias"):
            raise ValueError(f"model {name!r}: mlp_bias=True is not supported")
        if arch == "llama" and hf.get("attention_bias"):
            raise ValueError(f"model {name!r}: attention_bias=True for {hf_arch} (bias on o_proj "
                             "too) is not supported")
        rope_theta, rope_scaling = _parse_rope(hf)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = _ids(hf.get("eos_token_id")) + _ids((generation_config or {}).get("eos_token_id"))
        return cls(
            name=name,
            architecture=arch,
            path=path,
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _check_no_sliding_window(hf: dict[str, Any], hf_arch: str, max_pos: int) -> None:
    window = hf.get("sliding_window")
    if hf_arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
        window = None
    if window is not None and int(window) < max_pos:
        raise ValueError(f"{hf_arch} with sliding_window={window} < max_position_embeddings="
                         f"{max_pos} is not supported (sliding-window attention is not "
                         "implemented)")


def _parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers-5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` keys."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: "
                         f"{', '.join(ROPE_SCALING_TYPES)} (or none)")
    out = {"rope_type": kind}
    for key in _LLAMA3_KEYS:
        if key not in merged and key == "original_max_position_embeddings":
            merged[key] = hf.get("max_position_embeddings")
        if merged.get(key) is None:
            raise ValueError(f"llama3 rope_scaling lacks {key!r}")
        out[key] = merged[key]
    return theta, out
