"""Drafts in the scheduler's arithmetic: budget, blocks, rollback, prefix cache (no torch)."""

from common.engine.core.block_manager import BlockManager, hash_prefix_blocks
from common.engine.core.sampling_params import SamplingParams
from common.engine.core.scheduler import Scheduler, SchedulerConfig
from common.engine.core.sequence import Sequence


def make(num_blocks=32, block_size=4, budget=64):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(8, budget), bm, 4096), bm


def decoding(sched, prompts, first_token=99):
    """Running sequences one token short of their known tokens (prefill done, one sample)."""
    seqs = [Sequence(f"s{i}", list(p), SamplingParams(max_tokens=50))
            for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert len(out.scheduled) == len(seqs) and all(s.samples for s in out.scheduled)
    sched.update(out)
    for seq in seqs:
        seq.append_token(first_token)
    return seqs


def test_drafts_are_scheduled_after_the_known_token_and_counted():
    sched, bm = make()
    a, b = decoding(sched, [range(7), range(100, 105)])  # a: 8 known tokens, 7 computed
    a.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [
        (a, 4, [1, 2, 3]), (b, 1, [])]
    assert out.num_batched_tokens == 5
    assert all(s.samples for s in out.scheduled)
    # a's KV now covers positions 7..10: 11 tokens, three blocks of 4.
    assert len(a.block_table) == 3 and len(b.block_table) == 2


def test_drafts_are_trimmed_to_the_budget():
    sched, _ = make(budget=6)
    a, b = decoding(sched, [range(3), range(10, 13)])
    a.spec_token_ids = [1, 2, 3, 4]
    b.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    assert [(s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [
        (5, [1, 2, 3, 4]), (1, [])]


def test_drafts_never_preempt():
    sched, bm = make(num_blocks=3, block_size=4)
    # a: 8 known tokens in 2 blocks; b: 4 in 1 block; the pool is full
    a, b = decoding(sched, [range(7), range(10, 13)])
    assert bm.num_free_blocks == 0
    a.spec_token_ids = [1, 2]  # would need a third block
    out = sched.schedule()
    assert not out.preempted
    assert [(s.seq, s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [
        (a, 1, []), (b, 1, [])]


def test_rejected_drafts_roll_back_and_only_verified_blocks_are_hashed():
    sched, bm = make(block_size=4)
    (a,) = decoding(sched, [range(5)])  # known 0 1 2 3 4 99, computed 5
    a.spec_token_ids = [7, 8, 9]
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4  # positions 5..8: 99, 7, 8, 9
    # The verifier accepted 7 and rejected 8 (its own token there was 42).
    a.append_token(7)
    a.append_token(42)
    sched.update(out)
    assert a.num_computed_tokens == 7  # 99 and 7 keep their KV; 8 and 9 are discarded
    assert a.token_ids == [0, 1, 2, 3, 4, 99, 7, 42]
    assert a.spec_token_ids == []
    # One full block of verified tokens is hashed; the second (4 99 7 | 42 not computed) is not.
    assert a.block_hashes == hash_prefix_blocks(a.token_ids[:4], 4)
    assert bm.cached == {a.block_hashes[0]: a.block_table[0]}
    # All drafts accepted, plus the bonus token: computed stops one short of known.
    a.spec_token_ids = [5, 6, 1]
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4
    for t in (5, 6, 1, 77):
        a.append_token(t)
    sched.update(out)
    assert a.num_computed_tokens == a.num_tokens - 1 == 11
    assert a.block_hashes == hash_prefix_blocks(a.token_ids[:8], 4)
    bm.check_invariants()


def test_preemption_drops_drafts():
    sched, bm = make(num_blocks=4, block_size=4)
    a, b = decoding(sched, [range(8), range(10, 17)])  # 2 blocks each: the pool is full
    a.spec_token_ids = [1]
    b.spec_token_ids = [2]
    # a's next token needs a third block: its draft is dropped, then b (admitted last) is
    # preempted for a's known token.
    out = sched.schedule()
    assert out.preempted == [b] and b.spec_token_ids == [] and b.num_computed_tokens == 0
    assert [(s.seq, s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [(a, 1, [])]
