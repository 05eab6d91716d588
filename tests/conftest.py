"""Shared fixtures: the real default model (converted once into the user cache), accounting, and a
real redis-server (EmbeddedRedis, a free port, never 6379) per module with a fresh registry
namespace per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in the interpreter. It must be chosen before triton is first
# imported (building some HF models imports it), so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common.engine.config import DEFAULT_CACHE_DIR
from common.registry import EmbeddedRedis, Registry


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def registry(redis_server: EmbeddedRedis) -> Iterator[Registry]:
    reg = Registry(redis_server.url, namespace=f"test-{uuid.uuid4().hex[:8]}",
                   timeout_s=1.0, retries=1)
    yield reg
    reg.close()


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    return DEFAULT_CACHE_DIR


@pytest.fixture(scope="session")
def smollm2_dir(model_cache_dir: Path) -> Path:
    """The SmolLM2-135M-Instruct HF directory (GGUF converted on first use, then cached)."""
    from common.models.loader import DEFAULT_MODEL, resolve_model
    return resolve_model(DEFAULT_MODEL, model_cache_dir)
