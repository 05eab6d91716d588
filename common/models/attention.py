"""What one forward step's attention needs to know, and the backends that execute it.

A step is a flat, variable-length batch of T new tokens from B sequences. The first
`num_decodes` sequences contribute exactly one token each (and are the first num_decodes tokens);
the rest are prefill/extend chunks that attend to their cached prefix and causally to themselves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] int64: where each new token's K/V is written
    query_start_loc: torch.Tensor  # [B + 1] int32: sequence b owns tokens [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor         # [B] int32: context length after this step (prefix + new)
    block_tables: torch.Tensor     # [B, max_blocks] int32, padded with 0
    num_decodes: int               # leading sequences with exactly one new token
    num_decode_tokens: int         # == num_decodes (kept explicit for readability at call sites)
    max_query_len: int
    max_seq_len: int


class AttentionBackend(ABC):
    """Executes paged attention for one layer. Implementations: "torch" (batched plain torch with
    kernels.torch_ops's semantics, the CPU path) and "triton" (kernels' Triton kernels, the CUDA
    path). The cache tensors and metadata are passed in; the backend never allocates cache
    memory itself (the torch one keeps only the gather plan of the step's metadata object)."""

    name: str

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim], K/V of the new tokens already stored."""
