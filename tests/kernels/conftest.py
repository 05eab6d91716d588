"""Kernel tests run on the GPU when CUDA is present, else on the CPU through Triton's interpreter.

Without CUDA, TRITON_INTERPRET=1 must be set before `import triton` (Triton's own library
functions are decorated then) and stay set while kernels run (Triton imports more of itself at
the first launch). It is set here, so it is inherited by whatever this pytest process runs
later, child processes included; on a machine without CUDA that only means a Triton kernel runs
in the interpreter instead of failing for want of a GPU, so nothing else changes. With CUDA,
nothing is set.

If a test module collected before this directory imported triton (importing a transformers
model does), the interpreter cannot be switched on any more: the CPU cases then fail with a
message saying so (the cure is to set the variable in tests/conftest.py).

Tests are parametrized by `device`: "cpu" cases (small shapes, the interpreter) run only without
CUDA; "cuda" cases (real shapes, marked gpu) only with it.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Callable

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRETER_TOO_LATE = (not HAS_CUDA and "triton" in sys.modules
                        and os.environ.get("TRITON_INTERPRET") != "1")
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _skip_other_device(request: pytest.FixtureRequest) -> None:
    callspec = getattr(request.node, "callspec", None)
    device = callspec.params.get("device") if callspec is not None else None
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs CUDA")
    if device == "cpu" and HAS_CUDA:
        pytest.skip("CUDA present: the kernels are compiled for it, the interpreter is not used")
    if device == "cpu" and INTERPRETER_TOO_LATE:
        pytest.fail("triton was imported before tests/kernels/conftest.py could set "
                    "TRITON_INTERPRET=1; set it in tests/conftest.py instead")


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    """Different random inputs for every test case, reproducible from its id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _check_rel(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not out.isnan().any(), "NaN in the output: an element left unwritten (poisoned)?"
    diff = (out.double() - ref.double()).norm()
    err = (diff / ref.double().norm()).item()
    assert err < tol, f"relative error {err:.3e} >= {tol:.0e}"


@pytest.fixture
def check_rel() -> Callable[[torch.Tensor, torch.Tensor, float], None]:
    """check_rel(out, ref, tol): ||out - ref|| / ||ref|| < tol and no NaN in out."""
    return _check_rel


def _make_paged(seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: str, spare_blocks: int = 3,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V pools and block tables for sequences of the given lengths.

    Blocks are a random permutation of the pool (never contiguous per sequence, with spare
    blocks that belong to nobody), and the table is a column slice of a wider tensor, so its
    row stride is not its width. Returns (k_cache, v_cache, block_tables)."""
    per_seq = [-(-max(n, 1) // block_size) for n in seq_lens]
    width = max(per_seq, default=1)
    num_blocks = sum(per_seq) + spare_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.float32).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, dtype=torch.float32).to(device=device, dtype=dtype)
    perm = torch.randperm(num_blocks)
    wide = torch.zeros(len(seq_lens), width + 5, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        wide[i, :n] = perm[used:used + n].int()
        used += n
    return k_cache, v_cache, wide.to(device)[:, :width]


@pytest.fixture
def make_paged() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """make_paged(seq_lens, block_size, kv_heads, head_dim, dtype, device) -> (k, v, tables)."""
    return _make_paged
