"""Continuous batching under a token budget: chunked prefill, prefix reuse, preemption (pure Python).

The scheduler decides and the model runner executes: schedule() returns a SchedulerOutput naming,
for each sequence, how many of its known tokens to compute this step. Running sequences go first
(FCFS among themselves), then waiting ones are admitted while the token budget, max_num_seqs and
the block pool allow. When a running sequence cannot get a block, the most recently admitted
running sequence is preempted by recompute: its blocks are freed, its computed count reset, and it
goes back to the head of the waiting queue (prefix caching usually finds its blocks again).

Speculative decoding is the same arithmetic: a running sequence that carries draft tokens
(seq.spec_token_ids, proposed before schedule()) gets 1 + len(drafts) new tokens, counted in the
budget and in its blocks. Drafts are trimmed to the budget and dropped rather than preempting
anyone for them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.engine.core.block_manager import BlockManager
from common.engine.core.sampling_params import SamplingParams
from common.engine.core.sequence import FinishReason, Sequence, SequenceStatus
from common.flags import opt


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's limits, also the engine's "scheduler" flags."""
    max_num_seqs: int = opt(256, "most sequences in one batch")
    max_num_batched_tokens: int = opt(
        2048, "token budget of one step (chunked prefill splits longer prompts)")
    max_model_len: int | None = opt(None, "longest prompt + output (default: the model's)")
    enable_chunked_prefill: bool = opt(
        True, "split long prompts across steps and mix them with decodes")
    overlap_scheduling: str = opt("auto", "schedule and prepare step N+1 while step N runs on "
                                  "the device: auto (on for CUDA), on or off")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.overlap_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"overlap_scheduling must be auto, on or off, "
                             f"got {self.overlap_scheduling!r}")

    def resolved_max_model_len(self, model_limit: int) -> int:
        """--max-model-len clamped to what the model's positions allow (the one place it is)."""
        return min(self.max_model_len or model_limit, model_limit)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    # Tokens computed this step from seq.num_computed_tokens: known tokens, then the drafts.
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step
    # True when this step brings the sequence level with its known tokens: sample one more (and
    # verify the drafts). Fixed at scheduling time (update() moves num_computed_tokens afterwards).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        known = self.num_new_tokens - len(self.spec_token_ids)
        self.samples = self.seq.num_computed_tokens + known == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        """max_model_len: the resolved limit (config.resolved_max_model_len of the model's)."""
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= "
                             f"max_model_len ({config.max_num_batched_tokens} < {max_model_len})")
        self.config = config
        self.max_model_len = max_model_len
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence. One with blocks already (KV imported from a prefill service) runs
        directly if there is room in the batch; it holds its blocks either way."""
        if seq.block_table:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)

    def fork(self, parent: Sequence, request_id: str, params: SamplingParams,
             choice_index: int) -> Sequence:
        """Another choice of parent's request (n > 1), queued: the same prompt, no outputs, and
        parent's full blocks of computed prompt tokens shared by reference count.

            prompt:   | block 0 | block 1 | block 2 | partial |    (block_size 4, 14 tokens)
            parent:   | b7      | b3      | b9      | b2      |    KV of every prompt token
            child:    | b7      | b3      | b9      | new ... |    b7 b3 b9 referenced twice
                      |<- num_computed ------------>|<- computed by the child: 2 tokens

        The child computes the rest of the prompt itself, at least its last token (whose logits
        give the child's own first token, drawn with its own seed), so the partial last block is
        never shared: the child fills a block of its own. A prompt that ends on a block boundary
        shares all but its last block, as a prefix-cache hit does. Shared blocks hold prompt
        tokens only and nobody writes them again; each sequence drops its references when it
        finishes, is preempted or aborted, and the block is free when the last one does."""
        bs = self.bm.block_size
        shared = min(min(parent.num_computed_tokens, parent.num_prompt_tokens - 1) // bs,
                     len(parent.block_table))
        child = Sequence(request_id, list(parent.prompt_token_ids), params,
                         eos_token_ids=parent.eos_token_ids, arrival_time=parent.arrival_time,
                         parent_id=parent.request_id, choice_index=choice_index)
        child.block_table = parent.block_table[:shared]
        self.bm.ref_blocks(child.block_table)
        child.block_hashes = parent.block_hashes[:shared]
        child.num_computed_tokens = shared * bs
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        self.add(child)
        return child

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and release its blocks, unless it holds them for a handoff."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if not seq.hold_kv or reason is FinishReason.ABORT:
            self.bm.free(seq.block_table)

    # ---- scheduling -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        running = list(self.running)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget)
            if num_new <= 0 or not seq.is_ready:  # (a handed-off request's grammar compiles)
                i += 1
                continue
            num_drafts = max(0, num_new - seq.num_uncomputed_tokens)
            if num_drafts and not self.bm.allocate(seq.block_table,
                                                   seq.num_computed_tokens + num_new):
                num_new, num_drafts = num_new - num_drafts, 0  # no preemption for drafts
            while not self.bm.allocate(seq.block_table, seq.num_computed_tokens + num_new):
                victim = running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new, seq.spec_token_ids[:num_drafts]))
                budget -= num_new
                i += 1

        if not out.preempted:
            self._admit(out, budget, now)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            # FCFS among the sequences that are ready: one whose grammar compiles waits, and
            # does not hold up those behind it.
            seq = next((s for s in self.waiting if s.is_ready), None)
            if seq is None:
                break
            hit: list[int] = []
            # prompt_logprobs need the logits of every prompt position: no prefix hits.
            if seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is None:
                hit, hashes = self.bm.match_prefix(seq.token_ids)
            remaining = seq.num_tokens - len(hit) * self.bm.block_size
            num_new = min(remaining, budget)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                break
            needed = self.bm.blocks_needed(len(hit), len(hit) * self.bm.block_size + num_new)
            # Hit blocks that sit in the free queue are taken out of it by acquire_prefix.
            hit_free = sum(1 for b in hit if self.bm.blocks[b].ref_count == 0)
            if not self.bm.can_allocate(needed + hit_free):
                break
            self.waiting.remove(seq)
            if hit:
                self.bm.acquire_prefix(hit, seq.num_tokens)
                seq.block_table = list(hit)
                seq.block_hashes = hashes[:len(hit)]
                seq.num_computed_tokens = len(hit) * self.bm.block_size
            elif seq.num_computed_tokens == 0:
                self.bm.acquire_prefix([], seq.num_tokens)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            assert self.bm.allocate(seq.block_table, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq.block_table)
        seq.block_hashes.clear()
        seq.spec_token_ids = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the runner executed `out`, and register full blocks.

        A speculating sequence must have its verified tokens appended first. Its KV was computed
        for the last known token t and every draft d; only accepted drafts keep theirs:

            step:   | computed ....... | t | d1 d2 d3 |    KV written for t, d1, d2, d3
            after:  | computed ............ | d1 | x |    d1 accepted, x sampled (no KV yet)

        so computed stops one short of the known tokens, and the prefix cache only ever hashes
        blocks of verified tokens.
        """
        for s in out.scheduled:
            seq = s.seq
            if seq.is_finished:  # aborted, or (overlap scheduling) ended before this update
                continue
            advance = s.num_new_tokens
            if s.spec_token_ids:
                advance = min(advance, seq.num_tokens - 1 - seq.num_computed_tokens)
            if seq.spec_token_ids:  # proposals are for one step only
                seq.spec_token_ids = []
            seq.num_computed_tokens += advance
            self.bm.cache_full_blocks(seq.block_table, seq.block_hashes, seq.token_ids,
                                      seq.num_computed_tokens)
