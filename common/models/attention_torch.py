"""The "torch" attention backend: kernels.reference ops, the CPU serving path."""

from __future__ import annotations

import torch

from common.models.attention import AttentionBackend, AttentionMetadata
from kernels import reference


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = meta.num_decodes
        num_seqs = meta.seq_lens.shape[0]
        if nd == num_seqs:  # decode only
            return reference.paged_attention_decode(q, k_cache, v_cache, meta.block_tables,
                                                    meta.seq_lens, scale)
        qsl = meta.query_start_loc
        extend = reference.paged_attention_extend(
            q[nd:], k_cache, v_cache, meta.block_tables[nd:], qsl[nd:] - qsl[nd],
            meta.seq_lens[nd:], scale)
        if nd == 0:
            return extend
        decode = reference.paged_attention_decode(q[:nd], k_cache, v_cache,
                                                  meta.block_tables[:nd], meta.seq_lens[:nd],
                                                  scale)
        return torch.cat((decode, extend), dim=0)
