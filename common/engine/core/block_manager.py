"""Paged KV block pool with reference counts and automatic prefix caching (pure Python).

Rules
- A block is *referenced* while its ref_count > 0: by each sequence whose block table lists it,
  and by each handoff hold (prefill side, until the decode side confirms or the lease expires).
- A block whose ref_count drops to 0 goes to the tail of the free queue. If it is full and was
  hashed it stays findable in the prefix cache until it is reused: allocation takes from the head
  of the free queue (least recently freed first) and only then drops its hash (eviction).
- A sequence frees its blocks tail first, so that the end of a prompt is evicted before its head
  and shared prefixes live longest.
- Block hashes are chained: hash(parent_hash, block token ids, extra keys), so equal hashes mean
  equal whole prefixes. They are stable across processes (blake2b), which the registry's prefix
  index relies on.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NewType

from common.errors import NoFreeBlocksError

BlockHash = NewType("BlockHash", int)


def _token_bytes(token_ids: Seq[int]) -> bytes:
    """Each id as 4 little-endian unsigned bytes (struct.error outside [0, 2**32))."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _hash_bytes(parent: BlockHash | None, data: bytes, extra: bytes) -> BlockHash:
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little"))
    h.update(data)
    if extra:
        h.update(extra)
    return BlockHash(int.from_bytes(h.digest(), "little") >> 1)


def hash_block(parent: BlockHash | None, token_ids: Seq[int], extra_keys: tuple = ()) -> BlockHash:
    """blake2b-64 (top bit cleared) of the parent hash (8 bytes), the block's token ids
    (4 bytes each, little-endian) and repr(extra_keys) if any."""
    return _hash_bytes(parent, _token_bytes(token_ids),
                       repr(extra_keys).encode() if extra_keys else b"")


def hash_prefix_blocks(token_ids: Seq[int], block_size: int, extra_keys: tuple = ()) -> list[BlockHash]:
    """Chained hashes of every full block of token_ids (the ids packed once, not per block)."""
    num_full = len(token_ids) // block_size
    data = _token_bytes(token_ids[:num_full * block_size])
    extra = repr(extra_keys).encode() if extra_keys else b""
    step = 4 * block_size
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, num_full * step, step):
        parent = _hash_bytes(parent, data[start:start + step], extra)
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first. Values unused (OrderedDict as an ordered set).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        # Counters for metrics: prompt tokens looked up and found in the prefix cache.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def check_invariants(self) -> None:
        for b in self.blocks:
            assert b.ref_count >= 0, b
            assert (b.ref_count == 0) == (b.block_id in self.free_queue), b
        for h, bid in self.cached.items():
            assert self.blocks[bid].block_hash == h

    # ---- allocation -------------------------------------------------------------------------
    def _take_free(self) -> Block:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict from the prefix cache
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise AssertionError(f"block {block_id} freed more often than referenced")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def reset_prefix_cache(self) -> int:
        """Forget the prefix-cache entries of every unreferenced block (vLLM's
        reset_prefix_cache; benchmarks call it so that a repetition computes every prompt);
        blocks in use keep theirs. The number of entries forgotten."""
        dropped = 0
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                    dropped += 1
                block.block_hash = None
        return dropped

    def blocks_needed(self, num_held: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_queue)

    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow block_table in place to hold num_tokens; False (and no change) if the pool is short."""
        needed = self.blocks_needed(len(block_table), num_tokens)
        if needed > len(self.free_queue):
            return False
        block_table.extend(self._take_free().block_id for _ in range(needed))
        return True

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """num_blocks fresh blocks, each referenced once (for KV imported from another service)."""
        if num_blocks > len(self.free_queue):
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {len(self.free_queue)} free")
        return [self._take_free().block_id for _ in range(num_blocks)]

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block, tail first (see module docstring)."""
        for block_id in reversed(block_table):
            self._unref(block_id)
        block_table.clear()

    def ref_blocks(self, block_ids: Seq[int]) -> None:
        for block_id in block_ids:
            self._ref(block_id)

    def unref_blocks(self, block_ids: Seq[int]) -> None:
        for block_id in reversed(block_ids):
            self._unref(block_id)

    # ---- prefix caching ---------------------------------------------------------------------
    def match_prefix(self, token_ids: Seq[int], extra_keys: tuple = ()) -> tuple[list[int], list[BlockHash]]:
        """Cached blocks for the longest cached full-block prefix of token_ids, and all hashes.

        At least one token is always left to compute (its logits give the next token), so a
        prompt that is cached in full reuses all but its last block.
        """
        hashes = hash_prefix_blocks(token_ids, self.block_size, extra_keys)
        if not self.enable_prefix_caching:
            return [], hashes
        hit: list[int] = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        if len(hit) * self.block_size >= len(token_ids):
            hit.pop()
        return hit, hashes

    def acquire_prefix(self, block_ids: Seq[int], num_query_tokens: int) -> None:
        """Reference the matched prefix blocks for a sequence and count the lookup."""
        self.ref_blocks(block_ids)
        self.prefix_queries += num_query_tokens
        self.prefix_hits += len(block_ids) * self.block_size

    def cache_full_blocks(self, block_table: Seq[int], block_hashes: list[BlockHash],
                          token_ids: Seq[int], num_computed: int, extra_keys: tuple = ()) -> None:
        """Hash the blocks that are full of computed tokens and register them in the prefix cache.

        block_hashes (the sequence's list, extended in place) holds the hashes of blocks already
        registered; only the newly filled ones are hashed.
        """
        if not self.enable_prefix_caching:
            return
        num_full = num_computed // self.block_size
        parent = block_hashes[-1] if block_hashes else None
        for i in range(len(block_hashes), num_full):
            start = i * self.block_size
            parent = hash_block(parent, token_ids[start:start + self.block_size], extra_keys)
            block_hashes.append(parent)
            block = self.blocks[block_table[i]]
            if block.block_hash is None and parent not in self.cached:
                block.block_hash = parent
                self.cached[parent] = block.block_id
