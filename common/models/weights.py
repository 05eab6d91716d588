"""Copying a HF safetensors checkpoint into our model's (fused) parameters."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from common.models.llama import LlamaModel, WeightTarget

# Checkpoint tensors that carry nothing we need (recomputed buffers of older exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def load_safetensors(model: LlamaModel, model_dir: Path) -> None:
    """Fill every parameter of model from the checkpoint in model_dir (converting dtype and
    moving to the parameters' device). Missing or unexpected tensors are errors. A
    tensor-parallel rank reads only its slice of each tensor (safetensors' get_slice)."""
    targets = model.hf_weight_targets()
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    with torch.no_grad():
        for file in safetensors_files(model_dir):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    if name not in targets:
                        raise ValueError(f"{file.name}: unexpected tensor {name!r} for "
                                         f"{model.config.architecture} model")
                    target = targets[name]
                    sliced = f.get_slice(name)
                    shape = tuple(sliced.get_shape())
                    want = target.full
                    if shape != want:
                        raise ValueError(f"{file.name}: {name} has shape {shape}, expected "
                                         f"{want}")
                    copy_shard(target, sliced)
                    loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensor(s): "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")



def copy_shard(t: WeightTarget, source) -> None:
    """param[start:end] = this rank's slice of source, the checkpoint tensor (a tensor, or a
    safetensors slice: then only the slice is read)."""
    n = t.end - t.start if t.src_dim == 0 else t.param.shape[1]
    index = (slice(t.src_start, t.src_start + n) if t.src_dim == 0
             else (slice(None), slice(t.src_start, t.src_start + n)))
    t.param[t.start:t.end].copy_(source[index])
