"""The step-input builder: exact lists for a mixed step, and the two kinds of graph padding
(the example of common/engine/step_input.py's docstring, block size 4)."""

from __future__ import annotations

from common.engine.core.sampling_params import SamplingParams
from common.engine.core.scheduler import ScheduledSeq
from common.engine.core.sequence import Sequence
from common.engine.step_input import StepInput, build_step_input, decodes_first, step_rows

PARAMS = SamplingParams(max_tokens=8)
PROMPT = [100 + i for i in range(12)]


def _seq(name: str, tokens: list[int], computed: int, table: list[int]) -> Sequence:
    seq = Sequence(name, tokens, PARAMS)
    seq.num_computed_tokens = computed
    seq.block_table = table
    return seq


def _scheduled() -> list[ScheduledSeq]:
    """In the scheduler's order: a chunk, a decode, a speculating decode, a placeholder."""
    decode = _seq("decode", PROMPT[:9] + [42], 9, [3, 7, 1])  # position 9
    # Overlap scheduling: its last token is row 2 of the previous launch's sampled tokens.
    placeholder = _seq("placeholder", PROMPT[:5] + [-(1 + 2)], 5, [2, 6])
    chunk = _seq("chunk", PROMPT, 2, [5, 8])  # positions 2..6 of 12, across a block boundary
    spec = _seq("spec", PROMPT[:3] + [11], 3, [4, 9])  # known 11 at 3, drafts at 4 and 5
    return [ScheduledSeq(chunk, 5), ScheduledSeq(decode, 1), ScheduledSeq(spec, 3, [12, 13]),
            ScheduledSeq(placeholder, 1)]


def _mixed() -> tuple[list[ScheduledSeq], StepInput]:
    items = decodes_first(_scheduled())
    return items, build_step_input(step_rows(items), block_size=4)


def test_mixed_step():
    items, step = _mixed()
    assert [s.seq.request_id for s in items] == ["decode", "placeholder", "chunk", "spec"]
    assert [s.samples for s in items] == [True, True, False, True]
    assert step == StepInput(
        input_ids=[42, 0, 102, 103, 104, 105, 106, 11, 12, 13],
        positions=[9, 5, 2, 3, 4, 5, 6, 3, 4, 5],
        slot_mapping=[1 * 4 + 1, 6 * 4 + 1, 22, 23, 32, 33, 34, 4 * 4 + 3, 36, 37],
        query_start_loc=[0, 1, 2, 7, 10],
        seq_lens=[10, 6, 7, 6],
        block_tables=[3, 7, 1, 2, 6, 0, 5, 8, 0, 4, 9, 0],
        width=3, num_seqs=4, num_tokens=10, num_decodes=2, max_query_len=5, max_seq_len=10,
        placeholder_dst=[1], placeholder_src=[2],
        # The decodes' tokens; the speculating row's known token and both drafts.
        logit_rows=[0, 1, 7, 8, 9],
    )


def test_decode_graph_padding():
    items = decodes_first(_scheduled())[:2]
    step = build_step_input(step_rows(items), block_size=4)
    padded = step.padded_for_decode_graph(4)
    assert padded == step._replace(
        input_ids=[42, 0, 0, 0], positions=[9, 5, 0, 0], slot_mapping=[5, 25, -1, -1],
        query_start_loc=[0, 1, 2, 3, 4], seq_lens=[10, 6, 0, 0], num_decodes=4)
    # The real rows' part is unchanged: tables, counts, maxima, placeholders, logit rows.
    assert (padded.block_tables, padded.width, padded.num_seqs, padded.num_tokens) == (
        [3, 7, 1, 2, 6, 0], 3, 2, 2)
    assert (padded.max_query_len, padded.max_seq_len) == (1, 10)
    assert (padded.placeholder_dst, padded.placeholder_src, padded.logit_rows) == ([1], [2], [0, 1])
    assert step.input_ids == [42, 0]  # padding builds new lists


def test_prefill_graph_padding():
    _, step = _mixed()
    padded = step.padded_for_prefill_graph(16, 6)
    assert padded == step._replace(
        input_ids=step.input_ids + [0] * 6, positions=step.positions + [0] * 6,
        slot_mapping=step.slot_mapping + [-1] * 6,
        query_start_loc=[0, 1, 2, 7, 10, 10, 10], seq_lens=[10, 6, 7, 6, 0, 0])
    assert padded.num_decodes == 2 and padded.num_tokens == 10 and padded.num_seqs == 4
    assert len(step.input_ids) == 10


def test_rows_without_logits_and_one_row():
    # A chunk that does not catch up samples nothing; one decode is the whole batch.
    step = build_step_input(step_rows([_scheduled()[0]]), block_size=4)
    assert step.logit_rows == [] and step.num_decodes == 0 and step.max_query_len == 5
    decode = _scheduled()[1]
    step = build_step_input(step_rows([decode]), block_size=4)
    assert (step.input_ids, step.slot_mapping, step.logit_rows) == ([42], [5], [0])
