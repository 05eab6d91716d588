"""One step's input on the host, built once for either model runner (pure Python, no torch).

A step is a flat batch of rows, one per sequence, decodes (rows of one token) first: the
attention backends rely on it. A row computes its sequence's tokens [start, start + n); a
speculating sequence's row is its known tokens followed by its drafts, and it takes logits at
its last known token and at every draft. build_step_input() turns the rows into every list the
device needs; ModelRunner makes fresh tensors of them, CudaGraphRunner writes them into its
persistent buffers. An example, block size 4 (the step of tests/common/engine/test_step_input.py):

    row               decode     decode, placeholder   prefill chunk         speculating
    tokens            42         -(1 + 2)              5 tokens              11 | d1 d2
    positions         9          5                     2  3 | 4  5  6        3 | 4  5
    block_table       [3 7 1]    [2 6]                 [5 8]                 [4 9]
    input_ids         42         0                     t0 t1  t2 t3 t4       11  d1 d2
    slot_mapping      5          25                    22 23 | 32 33 34      19 | 36 37
    query_start_loc   0          1                     2                     7           (10)
    seq_lens          10         6                     7                     6
    logit_rows        0          1                     - (not caught up)     7  8  9

("|": a block boundary; block tables are padded with 0 to the widest, 3.)

A placeholder, -(1 + i), stands for row i of the tokens the previous launch sampled (overlap
scheduling, see common.engine.model_runner). It is only ever a decode row's one token: its input
id is 0 here, and the runner copies the real token over it on the device (placeholder_dst[k] <-
previous tokens[placeholder_src[k]]).

CUDA graphs are captured at fixed sizes, so a step is padded up to one (CudaGraphRunner):

    decode graph   (padded_for_decode_graph(rows)):     | real rows | 1 token | 1 token | ...
    prefill graph  (padded_for_prefill_graph(t, rows)): | real rows | 0 tokens | ... || extra tokens

Padding tokens are token 0 at position 0 with slot -1 (they write no K/V), padding rows have
context 0 (they read none) and no block-table row (whatever the buffers hold there is never
read); max_query_len and max_seq_len stay those of the real rows.
"""

from __future__ import annotations

from typing import NamedTuple

from common.engine.core.scheduler import ScheduledSeq


class StepRow(NamedTuple):
    """One sequence's part of a step."""
    token_ids: list[int]    # the tokens computed this step (a decode's may be a placeholder)
    start: int              # position of the first of them (the tokens before it are cached)
    block_table: list[int]  # the sequence's blocks, at least up to start + len(token_ids)
    num_logits: int = 0     # logit rows at its end: 0 (not caught up), 1, or 1 + its drafts


class StepInput(NamedTuple):
    """The host-side lists of one step (see the module docstring for the row layout)."""
    input_ids: list[int]              # [tokens], placeholders and padding as 0
    positions: list[int]              # [tokens]
    slot_mapping: list[int]           # [tokens]: block * block_size + offset; padding -1
    query_start_loc: list[int]        # [rows + 1]: row b owns tokens [qsl[b], qsl[b + 1])
    seq_lens: list[int]               # [rows]: context after this step; padding 0
    block_tables: list[int]           # [num_seqs * width], row-major: the real rows' tables,
                                      # each padded with 0 to width (one flat list uploads fastest)
    width: int                        # the longest real block table
    num_seqs: int                     # real rows (padding rows come after them)
    num_tokens: int                   # real tokens (padding tokens come after them)
    num_decodes: int                  # leading rows of one token (decode-graph padding counts)
    max_query_len: int                # of the real rows
    max_seq_len: int                  # of the real rows
    placeholder_dst: list[int]        # token (== row) of each placeholder in this step
    placeholder_src: list[int]        # its row in the previous launch's sampled tokens
    logit_rows: list[int]             # tokens whose logits are computed, in row order

    def padded_for_decode_graph(self, rows: int) -> StepInput:
        """This decode-only step as a decode graph of `rows` rows reads it: each padding row
        one token (token 0, position 0, slot -1), context 0. Call it on an unpadded step."""
        pad = rows - self.num_seqs
        end = self.query_start_loc[-1]
        return self._replace(
            input_ids=self.input_ids + [0] * pad, positions=self.positions + [0] * pad,
            slot_mapping=self.slot_mapping + [-1] * pad,
            query_start_loc=self.query_start_loc + list(range(end + 1, end + pad + 1)),
            seq_lens=self.seq_lens + [0] * pad, num_decodes=self.num_decodes + pad)

    def padded_for_prefill_graph(self, tokens: int, rows: int) -> StepInput:
        """This step as a prefill/mixed graph of `tokens` tokens and `rows` rows reads it:
        padding rows hold no token and have context 0; the tokens past the real ones (token
        0, position 0, slot -1) belong to no row. Call it on an unpadded step."""
        pad, extra = rows - self.num_seqs, tokens - self.num_tokens
        return self._replace(
            input_ids=self.input_ids + [0] * extra, positions=self.positions + [0] * extra,
            slot_mapping=self.slot_mapping + [-1] * extra,
            query_start_loc=self.query_start_loc + [self.query_start_loc[-1]] * pad,
            seq_lens=self.seq_lens + [0] * pad)


def decodes_first(scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The scheduled sequences in step order: decodes (one new token) first, each group in the
    scheduler's order."""
    return sorted(scheduled, key=lambda s: s.num_new_tokens != 1)


def step_rows(items: list[ScheduledSeq]) -> list[StepRow]:
    """The rows of scheduled sequences (in step order): the known tokens they compute, then
    their drafts; logits at the last known token and at each draft when the sequence samples."""
    rows: list[StepRow] = []
    for s in items:
        seq, start, drafts = s.seq, s.seq.num_computed_tokens, s.spec_token_ids
        tokens = seq.token_ids[start:start + s.num_new_tokens - len(drafts)]
        if drafts:
            tokens += drafts
        rows.append(StepRow(tokens, start, seq.block_table, 1 + len(drafts) if s.samples else 0))
    return rows


def build_step_input(rows: list[StepRow], block_size: int) -> StepInput:
    """The lists of one unpadded step; rows of one token must come first (decodes_first)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    dst: list[int] = []
    src: list[int] = []
    logit_rows: list[int] = []
    width = max(len(r.block_table) for r in rows)
    tables: list[int] = []
    num_decodes = 0
    max_query_len = 1
    for row, (tokens, start, table, num_logits) in enumerate(rows):
        n = len(tokens)
        if n == 1:  # a decode (rows of them come first: this row's token index is `row`)
            num_decodes += 1
            token = tokens[0]
            if token < 0:
                dst.append(row)
                src.append(-token - 1)
                token = 0
            ids.append(token)
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            ids += tokens
            positions += range(start, start + n)
            slots += [table[p // block_size] * block_size + p % block_size
                      for p in range(start, start + n)]
            max_query_len = max(max_query_len, n)
        end = qsl[-1] + n
        qsl.append(end)
        seq_lens.append(start + n)
        tables += table
        tables += [0] * (width - len(table))
        if num_logits:
            logit_rows += range(end - num_logits, end)
    return StepInput(
        input_ids=ids, positions=positions, slot_mapping=slots, query_start_loc=qsl,
        seq_lens=seq_lens, block_tables=tables, width=width, num_seqs=len(rows),
        num_tokens=qsl[-1], num_decodes=num_decodes, max_query_len=max_query_len,
        max_seq_len=max(seq_lens), placeholder_dst=dst, placeholder_src=src,
        logit_rows=logit_rows)
