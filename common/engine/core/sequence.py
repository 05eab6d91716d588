"""A request's state inside the engine: tokens known, tokens computed, blocks held (pure Python)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from common.engine.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the model's context length
    ABORT = "abort"      # cancelled by the client or the service
    GRAMMAR = "grammar"  # structured output: the grammar allows no next token (a dead end)


@dataclass(slots=True)
class Sequence:
    """Every request is "computed tokens catching up to known tokens".

        token_ids:  | prompt ............ | outputs ...... |
                    |<- num_computed ->|<- to compute ->|
                    |<- cached ->|  (prefix-cache hit, a subset of num_computed)

    A prefill chunk, a prefix hit, a decode step and "prefill ran on another service" all move
    num_computed_tokens towards len(token_ids); a token is sampled only when it gets there.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of full blocks, in order
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Draft tokens proposed for the next step (speculative decoding). They are not known tokens:
    # only those the target model verifies are appended to token_ids.
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured output: the request's matcher (common.engine.structured.GrammarState), or None.
    # The scheduler reads only its `ready` (False while the grammar compiles on another thread).
    grammar: Any = None
    # Keep the blocks when it finishes (a prefill service hands them off: engine.kv.held).
    hold_kv: bool = False
    # n > 1: the request this sequence is a choice of (None for choice 0, the request itself)
    # and its index among the request's choices (see Scheduler.fork).
    parent_id: str | None = None
    choice_index: int = 0
    # prompt_logprobs: one entry per prompt token (None for the first, and for those not yet
    # computed), filled as the prompt is computed; None once sent (or when not asked for).
    prompt_logprobs: list[Any] | None = None

    @property
    def is_ready(self) -> bool:
        """Whether the sequence may be scheduled: it has no grammar, or its grammar is compiled."""
        return self.grammar is None or self.grammar.ready

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def resolve_placeholder(self, token_id: int) -> None:
        """Overlap scheduling: the last token was a placeholder (negative) for a token sampled
        on the device; now its value is known."""
        self.output_token_ids[-1] = token_id
        self.token_ids[-1] = token_id
