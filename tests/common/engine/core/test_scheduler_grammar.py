"""The scheduler and structured outputs: a sequence whose grammar still compiles waits (no torch)."""

from common.engine.core.block_manager import BlockManager
from common.engine.core.sampling_params import SamplingParams
from common.engine.core.scheduler import Scheduler, SchedulerConfig
from common.engine.core.sequence import Sequence


class Gate:
    """Stands for common.engine.structured.GrammarState: only `ready` is read."""

    def __init__(self, ready: bool):
        self.ready = ready


def test_waiting_sequence_with_a_compiling_grammar_lets_the_next_one_in():
    sched = Scheduler(SchedulerConfig(8, 64), BlockManager(64, 4, True), 4096)
    a = Sequence("a", list(range(5)), SamplingParams(max_tokens=4))
    a.grammar = Gate(False)
    b = Sequence("b", list(range(10, 13)), SamplingParams(max_tokens=4))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 3)]
    assert list(sched.waiting) == [a]
    sched.update(out)
    b.append_token(7)
    a.grammar.ready = True
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 1), ("a", 5)]


def test_running_sequence_with_a_compiling_grammar_is_skipped():
    """A handed-off request (blocks imported, first token known) runs only once it is ready."""
    bm = BlockManager(64, 4, True)
    sched = Scheduler(SchedulerConfig(8, 64), bm, 4096)
    a = Sequence("a", list(range(8)), SamplingParams(max_tokens=4))
    a.block_table = bm.allocate_blocks(3)
    a.num_computed_tokens = 8
    a.append_token(99)
    a.grammar = Gate(False)
    sched.add(a)
    assert sched.schedule().is_empty
    a.grammar.ready = True
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("a", 1, True)]
