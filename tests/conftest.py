"""Shared fixtures: the real default model (converted once into the user cache) and accounting."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import DEFAULT_CACHE_DIR


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    return DEFAULT_CACHE_DIR


@pytest.fixture(scope="session")
def smollm2_dir(model_cache_dir: Path) -> Path:
    """The SmolLM2-135M-Instruct HF directory (GGUF converted on first use, then cached)."""
    from common.models.loader import DEFAULT_MODEL, resolve_model
    return resolve_model(DEFAULT_MODEL, model_cache_dir)
