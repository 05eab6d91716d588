"""The "triton" attention backend: the CUDA path, through kernels' Triton kernels.

The first meta.num_decodes sequences (one token each, the first tokens of the step) go through the
split-K decode kernel; the remaining sequences through the extend kernel. Neither launch reads a
value from the device, so a decode-only step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from common.models.attention import AttentionBackend, AttentionMetadata
from kernels import decode_attention, extend_attention, kv_store


class TritonAttentionBackend(AttentionBackend):
    """`decode_splits` fixes the split count of the decode kernel (None: chosen from the shapes;
    fix it when capturing CUDA graphs so every captured batch size is launched the same way).
    `decode_workspace`: the split partials (and fused-merge tickets), shared by every layer; it
    must hold decode_splits splits of the largest decode batch, and whoever passes it keeps it
    alive as long as any CUDA graph captured through this backend. None: each split launch
    allocates its own (inside a graph capture that comes from the graph's pool, and with
    DecodeConfig.fused_merge it adds a zero-fill to every layer)."""

    name = "triton"

    def __init__(self, decode_splits: int | None = None,
                 decode_config: decode_attention.DecodeConfig | None = None,
                 extend_config: extend_attention.ExtendConfig | None = None,
                 decode_workspace: decode_attention.DecodeWorkspace | None = None) -> None:
        self.decode_splits = decode_splits
        self.decode_config = decode_config
        self.extend_config = extend_config
        self.decode_workspace = decode_workspace

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        kv_store.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = meta.num_decodes
        num_seqs = meta.seq_lens.shape[0]
        out = torch.empty_like(q)
        if nd:
            decode_attention.paged_attention_decode(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                out=out[:nd], num_splits=self.decode_splits, workspace=self.decode_workspace,
                config=self.decode_config)
        if nd < num_seqs:
            # The decode tokens are the first nd of q, so the extend sequences start at nd.
            extend_attention.paged_attention_extend(
                q[nd:], k_cache, v_cache, meta.block_tables[nd:],
                meta.query_start_loc[nd:] - nd, meta.seq_lens[nd:], scale,
                out=out[nd:], config=self.extend_config)
        return out
