"""Scheduler: token budget, chunked prefill, prefix hits, preemption; no torch."""

from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.core.block_manager import BlockManager
from common.engine.core.sampling_params import SamplingParams
from common.engine.core.scheduler import Scheduler, SchedulerConfig
from common.engine.core.sequence import FinishReason, Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, prefix=True, max_len=4096):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(max_seqs, budget), bm, max_len), bm


def seq(rid, n, max_tokens=4, start=0):
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def run_step(sched, token=7):
    """Simulate the runner: advance computed counts; sampled sequences get `token`."""
    out = sched.schedule()
    sampled = [s.seq for s in out.scheduled if s.samples]
    sched.update(out)
    for s in sampled:
        s.append_token(token)
        if s.num_output_tokens >= s.params.max_tokens:
            sched.finish(s, FinishReason.LENGTH)
    return out


def test_chunked_prefill_splits_by_budget_and_mixes_with_decode():
    sched, _ = make(budget=10)
    a, b = seq("a", 3), seq("b", 25)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 3), ("b", 7)]
    out = run_step(sched)  # a decodes one token, b continues its prefill
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert not out.scheduled[1].samples
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.scheduled[1].samples and b.num_output_tokens == 1


def test_prefix_hit_computes_only_new_tokens():
    sched, bm = make(block_size=4, budget=64)
    a = seq("a", 14, max_tokens=1)
    sched.add(a)
    run_step(sched)
    assert a.is_finished and bm.num_used_blocks == 0
    b = Sequence("b", list(range(12)) + [50, 51, 52], SamplingParams(max_tokens=1))
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 3
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert b.block_table[:3] == a_blocks_prefix(bm, 3)


def a_blocks_prefix(bm, n):
    # the three cached prefix blocks are the first three allocated, ids 0..2
    return list(range(n))


def test_preemption_by_recompute_when_pool_runs_out():
    sched, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 7, max_tokens=8), seq("b", 7, max_tokens=8, start=100)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 blocks each, pool full
    assert bm.num_free_blocks == 0
    run_step(sched)  # token 8 still fits in block 2
    out = run_step(sched)  # a needs a third block for token 9 -> b is preempted
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_output_tokens == 2  # kept; recomputed later
    while sched.has_unfinished():
        run_step(sched)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert bm.num_used_blocks == 0


def test_max_num_seqs_limits_admission():
    sched, _ = make(max_seqs=2)
    for i in range(3):
        sched.add(seq(f"r{i}", 2))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
       st.integers(6, 40), st.integers(4, 48), st.booleans())
def test_everything_finishes_and_every_block_returns(reqs, num_blocks, budget, prefix):
    sched, bm = make(num_blocks=num_blocks, block_size=4, budget=budget, max_seqs=5,
                     prefix=prefix)
    seqs = []
    for i, (n, m) in enumerate(reqs):
        if -(-(n + m) // 4) > num_blocks:
            continue  # the engine rejects requests that can never fit
        s = seq(f"r{i}", n, max_tokens=m, start=i % 3)
        seqs.append(s)
        sched.add(s)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = run_step(sched)
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= 5
        bm.check_invariants()
    assert not sched.has_unfinished()
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert bm.num_used_blocks == 0
