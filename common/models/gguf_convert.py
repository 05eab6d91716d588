"""One-time conversion of a GGUF file into a float32 safetensors model directory (cached).

The cache entry is keyed by the file's size, mtime and path, so editing or replacing the GGUF
converts again. It is written into a temporary directory and renamed into place, so a crash
never leaves a half-written entry; later starts only read safetensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

log = logging.getLogger(__name__)


def gguf_cache_path(gguf_file: Path, cache_dir: Path) -> Path:
    """<cache_dir>/models/<stem>-<first 12 hex of sha256(size, mtime, path)>."""
    gguf_file = gguf_file.resolve()
    st = gguf_file.stat()
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{gguf_file}".encode()).hexdigest()[:12]
    return Path(cache_dir) / "models" / f"{gguf_file.stem}-{key}"


def convert_gguf(gguf_file: Path, cache_dir: Path) -> Path:
    """The converted model directory for gguf_file, converting it first if not cached."""
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    target = gguf_cache_path(gguf_file, cache_dir)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s into %s (one-time, about 20 s)", gguf_file, target)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_model_dir(gguf_file.resolve(), tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a concurrent converter finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf_file.name, time.monotonic() - start)
    return target


def _write_model_dir(gguf_file: Path, out: Path) -> None:
    # transformers is only needed for this one-time conversion.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = gguf_file.parent, gguf_file.name
    with tqdm(total=4, desc=f"converting {name}", unit="step") as bar:
        bar.set_postfix_str("dequantize")
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name,
                                                     dtype=torch.float32)
        bar.update()
        bar.set_postfix_str("weights")
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)  # shares storage with embed_tokens
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        bar.set_postfix_str("config")
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = config.get("architectures") or [type(model).__name__]
        config["dtype"] = "float32"
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if model.generation_config is not None:
            model.generation_config.save_pretrained(out)
        bar.update()
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        tokenizer.save_pretrained(out, save_jinja_files=False)  # chat_template in the json
        bar.update()
