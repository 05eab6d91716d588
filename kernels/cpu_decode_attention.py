"""Paged attention on the CPU, read in place from the pool (cpu_decode_attention.cpp): the CPU
path's decode rows (paged_decode_attention) and prefill/extend chunks (paged_extend_attention),
where the torch path copies each sequence's whole context out of the pool in every layer of
every step. The references are kernels.torch_ops.paged_attention_decode and
paged_attention_extend (tests/kernels/test_cpu_decode_attention.py compares them).

The C++ source is compiled on first use for this CPU (-march=native) and cached on disk
(kernels.cpu_build: a build directory named for the CPU's flags and the torch version, safe
against a process killed mid-build): about a minute the first time, a library load after.
`available()` says whether it built and runs here.

SmolLM2-135M, batch 32 at 450-token contexts, 2 cores (AVX-512), 30 layers (bench/
cpu_decode_step.py): float32 49.5 ms a step against the gathered path's 371 ms, bfloat16 44.5
against 68.6; the whole step 134.6 against 461.6 ms (fp32), 98.7 against 138.9 (bf16).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from kernels.cpu_build import cpu_tag, load, vector_move_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (32, 64, 96, 128, 256)


@functools.cache
def available() -> bool:
    """The kernel is built (now, if it was not) and gives the reference's result here."""
    if os.name != "posix" or not SOURCE.is_file():
        return False
    try:
        load(f"splitserve_cpu_attention_{cpu_tag()}", SOURCE,
             ["-O3", "-march=native", "-fopenmp", *vector_move_flags()])
        return _self_check()
    except (OSError, RuntimeError, ImportError, AssertionError) as e:
        log.warning("the CPU decode attention kernel is not available (%s): decodes gather "
                    "their context instead", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


def _self_check() -> bool:
    from kernels.torch_ops import paged_attention_decode
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(6, 4, 2, 64, generator=g) for _ in range(2))
    q = torch.randn(2, 4, 64, generator=g)
    tables = torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([9, 5], dtype=torch.int32)
    out = torch.empty_like(q)
    torch.ops.splitserve_cpu.paged_decode_attention(q, k, v, tables, lens, 0.25, out)
    ref = paged_attention_decode(q, k, v, tables, lens, 0.25)
    return torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def serves(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention takes these (else: the torch path)."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and k_cache.dtype == q.dtype
            and q.shape[-1] in HEAD_DIMS and available())


def paged_decode_attention(q: torch.Tensor,             # [n, heads, head_dim], rows strided
                           k_cache: torch.Tensor,       # [num_blocks, block_size, kv_heads, head_dim]
                           v_cache: torch.Tensor,
                           block_tables: torch.Tensor,  # [n, max_blocks] int32
                           seq_lens: torch.Tensor,      # [n] int32, context incl. the new token
                           scale: float,
                           out: torch.Tensor,           # q's shape, rows strided; written
                           ) -> None:
    """kernels.torch_ops.paged_attention_decode into out, in float32 (bf16 in and out)."""
    torch.ops.splitserve_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                    scale, out)


def paged_extend_attention(q: torch.Tensor,                # [T, heads, head_dim], rows strided
                           k_cache: torch.Tensor,          # [num_blocks, block_size, kv_heads, head_dim]
                           v_cache: torch.Tensor,
                           block_tables: torch.Tensor,     # [B, max_blocks] int32
                           query_start_loc: torch.Tensor,  # [B + 1] int32, offsets into T
                           seq_lens: torch.Tensor,         # [B] int32, context incl. new tokens
                           first_seq: int,
                           scale: float,
                           out: torch.Tensor,              # q's shape, rows strided; written
                           ) -> None:
    """kernels.torch_ops.paged_attention_extend of sequences first_seq .. B - 1 into their rows
    of out (the rows of the others are left as they are), in float32 with an online softmax,
    reading the contexts in place from the pool."""
    torch.ops.splitserve_cpu.paged_extend_attention(q, k_cache, v_cache, block_tables,
                                                    query_start_loc, seq_lens, first_seq, scale,
                                                    out)
