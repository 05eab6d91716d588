"""Block manager: exact block ids, free-queue order, prefix reuse, eviction; no torch."""


from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.core.block_manager import BlockManager, hash_prefix_blocks


def test_allocate_takes_lowest_free_blocks_and_frees_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a: list[int] = []
    assert bm.allocate(a, 9)  # 3 blocks
    assert a == [0, 1, 2]
    b: list[int] = []
    assert bm.allocate(b, 4)
    assert b == [3]
    bm.free(a)
    assert a == []
    # freed tail first: 2, 1, 0 go to the back of the queue after 4..7
    assert list(bm.free_queue) == [4, 5, 6, 7, 2, 1, 0]
    assert bm.num_free_blocks == 7
    bm.check_invariants()


def test_allocation_fails_without_partial_change():
    bm = BlockManager(num_blocks=2, block_size=4)
    t: list[int] = []
    assert not bm.allocate(t, 9)
    assert t == [] and bm.num_free_blocks == 2


def test_prefix_reuse_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=4)
    tokens = list(range(12))  # three full blocks
    table: list[int] = []
    hashes: list = []
    assert bm.allocate(table, 12)
    bm.cache_full_blocks(table, hashes, tokens, 12)
    assert hashes == hash_prefix_blocks(tokens, 4)
    bm.free(table)
    # a longer prompt sharing the 3-block prefix finds all three blocks
    hit, all_hashes = bm.match_prefix(tokens + [99, 98])
    assert hit == [0, 1, 2] and all_hashes == hashes
    # the same prompt exactly: the last block is recomputed (one token must be computed)
    hit_same, _ = bm.match_prefix(tokens)
    assert hit_same == [0, 1]
    # allocating 3 fresh blocks takes the never-used ones first, then evicts LRU (tail first)
    other: list[int] = []
    assert bm.allocate(other, 16)
    assert other == [3, 4, 5, 2]
    hit_after, _ = bm.match_prefix(tokens + [1])
    assert hit_after == [0, 1]
    bm.free(other)
    bm.check_invariants()


def test_reset_prefix_cache_forgets_only_unreferenced_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    kept, dropped = list(range(8)), list(range(100, 108))  # two full blocks each
    tables = {}
    for name, tokens in (("kept", kept), ("dropped", dropped)):
        table: list[int] = []
        assert bm.allocate(table, 8)
        bm.cache_full_blocks(table, [], tokens, 8)
        tables[name] = table
    bm.free(tables["dropped"])
    assert bm.reset_prefix_cache() == 2
    assert bm.match_prefix(dropped + [1])[0] == []   # forgotten: computed again
    assert bm.match_prefix(kept + [1])[0] == [0, 1]  # in use: still findable
    assert bm.num_free_blocks == 6 and bm.reset_prefix_cache() == 0
    bm.free(tables["kept"])
    bm.check_invariants()


def test_shared_blocks_are_refcounted():
    bm = BlockManager(num_blocks=4, block_size=2)
    t1: list[int] = []
    assert bm.allocate(t1, 4)
    bm.cache_full_blocks(t1, [], [1, 2, 3, 4], 4)
    hit, _ = bm.match_prefix([1, 2, 3, 4, 5])
    bm.acquire_prefix(hit, 5)
    assert [bm.blocks[b].ref_count for b in hit] == [2, 2]
    assert bm.prefix_hits == 4 and bm.prefix_queries == 5
    bm.free(t1)
    assert bm.num_free_blocks == 2
    bm.unref_blocks(hit)
    assert bm.num_free_blocks == 4
    bm.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache"]),
                          st.integers(0, 5), st.integers(1, 40)), max_size=60))
def test_random_operations_keep_exact_accounting(ops):
    bm = BlockManager(num_blocks=16, block_size=4)
    tables: list[list[int]] = [[] for _ in range(6)]
    hashes: list[list] = [[] for _ in range(6)]
    for op, i, n in ops:
        if op == "alloc":
            before = bm.num_free_blocks
            ok = bm.allocate(tables[i], len(tables[i]) * 4 + n)
            if not ok:
                assert bm.num_free_blocks == before
        elif op == "free":
            bm.free(tables[i])
            hashes[i] = []
        elif tables[i]:
            toks = [i] * (len(tables[i]) * 4)
            bm.cache_full_blocks(tables[i], hashes[i], toks, len(toks))
        bm.check_invariants()
        held = sum(len(t) for t in tables)
        assert bm.num_used_blocks == held
    for t in tables:
        bm.free(t)
    assert bm.num_free_blocks == 16


def test_block_hashes_keep_their_documented_bytes():
    """The registry's prefix index compares hashes across processes and versions: the hash is
    blake2b-64 of the parent (8 bytes), the ids (4 little-endian bytes each) and the extra keys."""
    import hashlib
    import random

    from common.engine.core.block_manager import hash_block

    def documented(parent, ids, extra=()):
        h = hashlib.blake2b(digest_size=8)
        h.update((parent or 0).to_bytes(8, "little"))
        h.update(b"".join(t.to_bytes(4, "little") for t in ids))
        if extra:
            h.update(repr(extra).encode())
        return int.from_bytes(h.digest(), "little") >> 1

    rng = random.Random(5)
    for extra in ((), ("lora-a", 3)):
        tokens = [rng.randrange(2**32) for _ in range(70)]
        parent, want = None, []
        for start in range(0, 64, 16):
            parent = documented(parent, tokens[start:start + 16], extra)
            want.append(parent)
        assert hash_prefix_blocks(tokens, 16, extra) == want
        assert hash_block(want[0], tokens[16:32], extra) == want[1]
    assert hash_prefix_blocks(tokens[:15], 16) == []
