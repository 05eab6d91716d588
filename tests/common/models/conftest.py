"""A tiny paged KV pool that drives our model step by step, as a model runner would."""

from __future__ import annotations

import pytest
import torch

from common.models.attention import AttentionMetadata
from common.models.attention_torch import TorchAttentionBackend
from common.models.llama import LlamaModel


class PagedRunner:
    """Runs flat steps of (seq_id, new token ids) chunks through the model on a paged cache.

    Blocks are handed out in a scrambled order, so block tables are not contiguous. Leading
    one-token chunks count as decodes (AttentionMetadata.num_decodes).
    """

    def __init__(self, model: LlamaModel, num_blocks: int = 64, block_size: int = 16):
        c = model.config
        self.model = model
        self.block_size = block_size
        weight = model.embed_tokens.weight
        self.device = weight.device
        self.kv_cache = torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads,
                                    c.head_dim, dtype=weight.dtype, device=self.device)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.backend = TorchAttentionBackend()
        self.last_meta: AttentionMetadata | None = None

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Logits [n_new, vocab] for each chunk's tokens."""
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for seq_id, tokens in chunks:
            table = self.tables.setdefault(seq_id, [])
            start = self.lens.get(seq_id, 0)
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for p in range(start, end):
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            ids += tokens
            positions += range(start, end)
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            self.lens[seq_id] = end
        num_decodes = 0
        while num_decodes < len(chunks) and len(chunks[num_decodes][1]) == 1:
            num_decodes += 1
        width = max(len(self.tables[s]) for s, _ in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s, _ in chunks]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            max_query_len=max(len(t) for _, t in chunks), max_seq_len=max(seq_lens))
        self.last_meta = meta
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                                torch.tensor(positions, dtype=torch.int64, device=dev),
                                self.kv_cache, meta, self.backend)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([len(t) for _, t in chunks]))


@pytest.fixture
def paged_runner():
    return PagedRunner
