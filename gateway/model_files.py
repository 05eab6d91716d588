"""The model files the gateway reads (tokenizer, config.json), found without torch.

The gateway never converts a model: a GGUF (or the default model) is converted by the first
prefill or decode service that loads it (`splitserve up` converts before starting any), and the
gateway waits for the converted directory to appear in the shared cache.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("splitserve.gateway.model")


@dataclass(frozen=True, slots=True)
class ModelFiles:
    directory: Path
    max_model_len: int
    vocab_size: int


def find_model_dir(model: str, cache_dir: str) -> Path | None:
    """The HF directory for a model spec, or None while a GGUF spec is not converted yet."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    # A converted GGUF lives in <cache_dir>/models/<gguf stem>-<key>; the default model's
    # GGUF stem starts with its name (SmolLM2-135M-Instruct.Q4_1).
    stem = path.stem if path.suffix == ".gguf" else model
    candidates = [d for d in (Path(cache_dir) / "models").glob(f"{stem}*")
                  if d.is_dir() and not d.name.startswith(".") and (d / "config.json").is_file()]
    return max(candidates, key=lambda d: d.stat().st_mtime, default=None)


def wait_for_model_files(model: str, cache_dir: str, tokenizer: str | None,
                         timeout_s: float, poll_s: float = 1.0) -> ModelFiles:
    deadline = time.monotonic() + timeout_s
    logged = False
    while True:
        directory = Path(tokenizer) if tokenizer else find_model_dir(model, cache_dir)
        if directory is not None and (directory / "config.json").is_file():
            break
        if time.monotonic() > deadline:
            raise FileNotFoundError(
                f"no converted model directory for {model!r} under {cache_dir}/models after "
                f"{timeout_s:.0f} s; start a prefill service (it converts the model) or pass "
                "--tokenizer DIR")
        if not logged:
            log.info("waiting for %r to be converted into %s/models", model, cache_dir)
            logged = True
        time.sleep(poll_s)
    config = json.loads((directory / "config.json").read_text())
    return ModelFiles(directory, int(config.get("max_position_embeddings", 2048)),
                      int(config["vocab_size"]))
