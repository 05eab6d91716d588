"""Scheduler.fork (n > 1): a choice shares its parent's full prompt blocks by reference count and
computes the rest itself; exact block ids, ref counts, and the pool back to full (no torch)."""

from common.engine.core.block_manager import BlockManager
from common.engine.core.sampling_params import SamplingParams
from common.engine.core.scheduler import Scheduler, SchedulerConfig
from common.engine.core.sequence import FinishReason, Sequence, SequenceStatus


def make(num_blocks=16, block_size=4, budget=64):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(8, budget), bm, 4096), bm


def step(sched, token=7):
    """The runner's part: advance computed counts; every sequence that samples gets `token`."""
    out = sched.schedule()
    sampled = [s.seq for s in out.scheduled if s.samples]
    sched.update(out)
    for s in sampled:
        s.append_token(token)
    return out


def prefilled_parent(sched, num_prompt, max_tokens=8):
    parent = Sequence("r", list(range(100, 100 + num_prompt)), SamplingParams(max_tokens=max_tokens))
    sched.add(parent)
    step(sched)  # the whole prompt in one chunk, first token out
    assert parent.num_output_tokens == 1
    return parent


def refs(bm, ids):
    return [bm.blocks[b].ref_count for b in ids]


def test_fork_shares_full_blocks_and_recomputes_the_partial_one():
    sched, bm = make()
    parent = prefilled_parent(sched, 14)  # blocks 0 1 2 full, 3 holds tokens 12, 13
    assert parent.block_table == [0, 1, 2, 3]
    child = sched.fork(parent, "r#1", SamplingParams(max_tokens=8, seed=1), 1)
    assert child.block_table == [0, 1, 2] and child.num_computed_tokens == 12
    assert child.status is SequenceStatus.RUNNING and child.parent_id == "r"
    assert child.choice_index == 1 and child.token_ids == parent.prompt_token_ids
    assert refs(bm, [0, 1, 2, 3]) == [2, 2, 2, 1]
    out = step(sched)
    # The parent decodes one token; the child computes prompt tokens 12 and 13 into a block of
    # its own (the next free one) and samples its first token.
    assert [(s.seq.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("r", 1, True), ("r#1", 2, True)]
    assert child.block_table == [0, 1, 2, 4] and child.num_output_tokens == 1
    assert bm.num_free_blocks == 16 - 5
    sched.finish(parent, FinishReason.STOP)  # the shared blocks stay, the child holds them
    assert refs(bm, [0, 1, 2, 3, 4]) == [1, 1, 1, 0, 1]
    assert list(bm.free_queue)[-1] == 3  # the parent's own last block, freed last
    sched.finish(child, FinishReason.LENGTH)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_block_aligned_prompt_shares_all_but_its_last_block():
    sched, bm = make()
    parent = prefilled_parent(sched, 12)  # exactly three blocks; the first token needs a fourth
    assert parent.block_table == [0, 1, 2]
    children = [sched.fork(parent, f"r#{i}", SamplingParams(max_tokens=8), i) for i in (1, 2)]
    assert [c.block_table for c in children] == [[0, 1], [0, 1]]
    assert [c.num_computed_tokens for c in children] == [8, 8]
    assert refs(bm, [0, 1, 2]) == [3, 3, 1]
    out = step(sched)  # parent: token 12 into a new block 3; each child: tokens 8-11
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("r", 1), ("r#1", 4), ("r#2", 4)]
    assert parent.block_table == [0, 1, 2, 3]
    assert [c.block_table for c in children] == [[0, 1, 4], [0, 1, 5]]
    for s in (children[1], parent, children[0]):
        sched.finish(s, FinishReason.STOP)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_short_prompt_shares_nothing_and_queues():
    sched, bm = make()
    parent = prefilled_parent(sched, 3)
    child = sched.fork(parent, "r#1", SamplingParams(max_tokens=8), 1)
    assert child.block_table == [] and child.num_computed_tokens == 0
    assert child.status is SequenceStatus.WAITING
    out = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("r", 1), ("r#1", 3)]
    assert child.block_table == [1]
    sched.finish(parent, FinishReason.STOP)
    sched.finish(child, FinishReason.ABORT)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_preempted_child_drops_only_its_references():
    sched, bm = make(num_blocks=6)
    parent = prefilled_parent(sched, 14)  # blocks 0-3
    child = sched.fork(parent, "r#1", SamplingParams(max_tokens=8), 1)
    step(sched)  # child: [0, 1, 2, 4]; one block (5) left
    assert child.block_table == [0, 1, 2, 4] and bm.num_free_blocks == 1
    while bm.num_free_blocks:  # the parent grows until the pool runs dry
        step(sched)
    for _ in range(4):  # then it preempts the newest running sequence: the child
        out = step(sched)
        if out.preempted:
            break
    assert out.preempted == [child] and child.num_computed_tokens == 0
    assert child.status is SequenceStatus.WAITING and child.block_table == []
    assert refs(bm, [0, 1, 2]) == [1, 1, 1]  # the parent's references only
    sched.finish(parent, FinishReason.ABORT)
    sched.finish(child, FinishReason.ABORT)
    assert bm.num_free_blocks == 6
    bm.check_invariants()


def test_choice_settings():
    p = SamplingParams(seed=41, n=3, prompt_logprobs=2, temperature=0.7)
    assert [(c.seed, c.n, c.prompt_logprobs) for c in (p.choice(0), p.choice(1), p.choice(2))] == [
        (41, 1, 2), (42, 1, None), (43, 1, None)]
    assert SamplingParams(n=2).choice(1).seed is None
