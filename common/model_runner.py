"""Executes a SchedulerOutput: builds the flat batch, runs the model, samples (mechanism only).

The runner makes no policy decision; it turns "compute these tokens of these sequences" into
tensors, owns the KV pool, and returns one sampled token per sequence that caught up.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch

from common.config import EngineConfig
from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.model_config import ModelConfig
from common.sampler import Sampler, SamplerOutput
from common.scheduler import ScheduledSeq, SchedulerOutput
from common.sequence import Sequence

KVAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def default_kv_allocator(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from common.models.attention_triton import TritonAttentionBackend
        return TritonAttentionBackend()
    from common.models.attention_torch import TorchAttentionBackend
    return TorchAttentionBackend()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 device: torch.device, dtype: torch.dtype,
                 kv_cache_allocator: KVAllocator | None = None):
        self.model = model
        self.mc = model_config
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.backend = make_attention_backend(config.attention_backend, device)
        self.sampler = Sampler()
        self.num_blocks = self._pool_size()
        shape = (model_config.num_layers, 2, self.num_blocks, self.block_size,
                 model_config.num_kv_heads, model_config.head_dim)
        self.kv_cache = (kv_cache_allocator or default_kv_allocator)(shape, dtype, device)

    @property
    def bytes_per_block(self) -> int:
        mc = self.mc
        return (2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim
                * torch.empty((), dtype=self.dtype).element_size())

    def _pool_size(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.kv_cache_memory_fraction
        else:
            budget = min(self.config.cpu_kv_cache_gib * 2**30,
                         psutil.virtual_memory().available * self.config.kv_cache_memory_fraction)
        return max(1, int(budget // self.bytes_per_block))

    # ---- one step -----------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[list[ScheduledSeq], torch.Tensor,
                                                      torch.Tensor, AttentionMetadata]:
        """Order decodes first (the attention backends rely on it) and build the flat batch."""
        items = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        num_decodes = sum(1 for s in items if s.num_new_tokens == 1)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        max_blocks = max(len(s.seq.block_table) for s in items)
        tables: list[list[int]] = []
        for s in items:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + s.num_new_tokens)
            seq_lens.append(end)
            tables.append(table + [0] * (max_blocks - len(table)))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_query_len=max(s.num_new_tokens for s in items),
            max_seq_len=max(seq_lens),
        )
        return (items, torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[Sequence], SamplerOutput]:
        """Run one step; returns the sequences that sampled, and their samples (same order)."""
        items, input_ids, positions, meta = self.prepare(out)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.backend)
        last = meta.query_start_loc[1:] - 1
        sampling = [i for i, s in enumerate(items) if s.samples]
        seqs = [items[i].seq for i in sampling]
        if not seqs:
            return [], SamplerOutput([], [])
        idx = last[torch.tensor(sampling, device=self.device)] if len(sampling) < len(items) else last
        logits = self.model.compute_logits(hidden[idx.long()])
        return seqs, self.sampler(logits, seqs)

    # ---- KV blocks in and out (handoff) -------------------------------------------------------
    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.kv_cache.index_select(2, ids)

    def import_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self.kv_cache.index_copy_(2, ids, kv.to(device=self.device, dtype=self.kv_cache.dtype))
