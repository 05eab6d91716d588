"""Shared fixtures: the real default model (converted once into the user cache) and accounting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in the interpreter. It must be chosen before triton is first
# imported (building some HF models imports it), so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common.engine.config import DEFAULT_CACHE_DIR


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    return DEFAULT_CACHE_DIR


@pytest.fixture(scope="session")
def smollm2_dir(model_cache_dir: Path) -> Path:
    """The SmolLM2-135M-Instruct HF directory (GGUF converted on first use, then cached)."""
    from common.models.loader import DEFAULT_MODEL, resolve_model
    return resolve_model(DEFAULT_MODEL, model_cache_dir)
