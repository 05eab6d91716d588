"""Tensor parallelism for our decoder (Megatron-style): which slice of every weight one rank
holds, and the collectives a sharded forward calls.

Rank r of N holds (H heads, KV kv-heads, I the MLP width, V the vocabulary, d the head dim):

    qkv_proj   column-parallel: q heads [r*H/N, (r+1)*H/N), and its KV heads (below)
    o_proj     row-parallel: the same q heads' input columns, then one all-reduce
    gate_up    column-parallel: gate rows [r*I/N, (r+1)*I/N), and the same up rows
    down_proj  row-parallel: the same input columns, then one all-reduce
    embedding  vocab-parallel: rows [r*V/N, (r+1)*V/N); ids outside them embed as zeros, and
               one all-reduce sums the ranks' rows (exactly one is not zero)
    lm_head    vocab-parallel: the same rows (the embedding's own when they are tied); rank 0
               gathers the ranks' logits, [n, V/N] each, into [n, V]
    norms      replicated

KV heads: N <= KV gives each rank KV/N of them (the KV heads of its q heads); N > KV (N a
multiple of KV) gives each rank one, replicated on N/KV ranks: rank r holds KV head
r // (N/KV), as vLLM does. Either way a rank's q heads are exactly the queries of its KV heads,
so attention needs no communication, and the rank's KV pool holds only its KV heads.

Sums change order under TP (each rank sums its slice, then the all-reduce sums the ranks), so
logits differ from TP 1 by float rounding only.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from common.errors import ConfigError
from common.models.model_config import ModelConfig


class Shard(NamedTuple):
    """Which rank this process is, of how many."""
    rank: int = 0
    size: int = 1


NO_SHARD = Shard()  # the whole model (TP 1)


class ShardLayout(NamedTuple):
    """The sizes of one rank's slices, and where they start in the full weights."""
    shard: Shard
    num_heads: int        # q heads on this rank
    num_kv_heads: int     # KV heads on this rank (replicas count once per rank)
    head_dim: int
    intermediate: int     # MLP width on this rank
    vocab: int            # vocabulary rows on this rank
    head_start: int       # first q head
    kv_head_start: int    # first KV head
    vocab_start: int      # first vocabulary row

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def inter_start(self) -> int:
        return self.shard.rank * self.intermediate


def shard_layout(c: ModelConfig, shard: Shard = NO_SHARD) -> ShardLayout:
    """Rank shard.rank's slices; a ConfigError naming the numbers when shard.size does not
    divide the heads (after KV replication), the MLP width or the vocabulary."""
    n, r = shard.size, shard.rank
    if n < 1 or not 0 <= r < n:
        raise ConfigError(f"rank {r} of tensor parallel size {n}")
    what = f"tensor parallel size {n}"
    if c.num_heads % n:
        raise ConfigError(f"{what} does not divide the {c.num_heads} attention heads of "
                          f"{c.name}")
    kv = c.num_kv_heads
    if n <= kv and kv % n:
        raise ConfigError(f"{what} does not divide the {kv} KV heads of {c.name} (a size above "
                          f"{kv} must be a multiple of {kv}: each KV head is then replicated)")
    if n > kv and n % kv:
        raise ConfigError(f"{what} is not a multiple of the {kv} KV heads of {c.name}, so they "
                          "cannot be replicated evenly (use a divisor or a multiple of "
                          f"{kv})")
    if c.intermediate_size % n:
        raise ConfigError(f"{what} does not divide the MLP width {c.intermediate_size} of "
                          f"{c.name}")
    if c.vocab_size % n:
        raise ConfigError(f"{what} does not divide the vocabulary of {c.name} "
                          f"({c.vocab_size} tokens)")
    heads, inter, vocab = c.num_heads // n, c.intermediate_size // n, c.vocab_size // n
    kv_heads, kv_start = (kv // n, r * (kv // n)) if n <= kv else (1, r // (n // kv))
    return ShardLayout(shard, heads, kv_heads, c.head_dim, inter, vocab, r * heads, kv_start,
                       r * vocab)


class Collectives(Protocol):
    """What a sharded forward calls: implemented over a torch.distributed process group
    (common.engine.parallel.RankGroup), and by SINGLE for one rank. Every call is made by all
    ranks in the same order."""

    size: int
    rank: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (x is returned)."""
        ...

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """The ranks' x side by side in the last dim on rank 0 ([..., size * n]); None
        elsewhere."""
        ...

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        ...


class _Single:
    size, rank = 1, 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return x


SINGLE: Collectives = _Single()
