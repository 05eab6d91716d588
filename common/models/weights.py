"""Copying a HF safetensors checkpoint into our model's (fused) parameters, and an FP8 one's
weights and scales into its Fp8Linears (common.models.fp8_checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from common.models.fp8_checkpoint import (
    INPUT_SCALE_SUFFIX,
    Fp8Scheme,
    ScaleTarget,
    checkpoint_targets,
    copy_scale,
)
from common.models.llama import LlamaModel, WeightTarget

# Checkpoint tensors that carry nothing we need (recomputed buffers of older exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FP8_E4M3 = "F8_E4M3"  # safetensors' name for torch.float8_e4m3fn


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: those named by model.safetensors.index.json, else *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shard(s) {missing} in {model_dir}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {model_dir}")
    return files


def load_safetensors(model: LlamaModel, model_dir: Path, scheme: Fp8Scheme | None = None) -> None:
    """Fill every parameter of model from the checkpoint in model_dir (converting dtype and
    moving to the parameters' device). Missing or unexpected tensors are errors. A
    tensor-parallel rank reads only its slice of each tensor (safetensors' get_slice).
    scheme: the checkpoint's FP8 scheme (common.models.fp8_checkpoint), its projections then
    loaded as they are into the model's Fp8Linears (fp8_checkpoint.prepare_model)."""
    targets: dict[str, WeightTarget | ScaleTarget] = dict(model.hf_weight_targets())
    if scheme is not None:
        targets = checkpoint_targets(model.hf_weight_targets())
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    with torch.no_grad():
        for file in safetensors_files(model_dir):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    if scheme is not None and name.endswith(INPUT_SCALE_SUFFIX):
                        continue  # static activation scales: see fp8_checkpoint
                    what = f"{file.name}: {name}"
                    if name not in targets:
                        raise ValueError(f"{file.name}: unexpected tensor {name!r} for "
                                         f"{_describe(model, scheme)}")
                    target = targets[name]
                    if isinstance(target, ScaleTarget):
                        copy_scale(target, f.get_tensor(name), scheme, what)
                    else:
                        sliced = f.get_slice(name)
                        _check_tensor(what, tuple(sliced.get_shape()), sliced.get_dtype(),
                                      target, scheme)
                        copy_shard(target, sliced)
                    loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensor(s): "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _describe(model: LlamaModel, scheme: Fp8Scheme | None) -> str:
    what = f"{model.config.architecture} model"
    return what if scheme is None else (f"{what} ({scheme.method} fp8: only the decoder "
                                        "layers' projections can be fp8)")


def _check_tensor(what: str, shape: tuple[int, ...], dtype: str, target: WeightTarget,
                  scheme: Fp8Scheme | None) -> None:
    if shape != target.full:
        raise ValueError(f"{what} has shape {shape}, expected {target.full}")
    fp8_target = target.param.dtype == torch.float8_e4m3fn
    if fp8_target and dtype != _FP8_E4M3:
        raise ValueError(f"{what} is {dtype}, expected float8_e4m3fn ({_FP8_E4M3}): every "
                         f"projection of a {scheme.method} fp8 checkpoint must be fp8 "
                         "(checkpoints that leave some in full precision are not supported)")
    if not fp8_target and dtype.startswith("F8"):
        where = ("config.json declares no quantization_config" if scheme is None
                 else "only the decoder layers' projections can be fp8")
        raise ValueError(f"{what} is {dtype} (fp8), but {where}")


def copy_shard(t: WeightTarget, source) -> None:
    """param[start:end] = this rank's slice of source, the checkpoint tensor (a tensor, or a
    safetensors slice: then only the slice is read)."""
    n = t.end - t.start if t.src_dim == 0 else t.param.shape[1]
    index = (slice(t.src_start, t.src_start + n) if t.src_dim == 0
             else (slice(None), slice(t.src_start, t.src_start + n)))
    t.param[t.start:t.end].copy_(source[index])
