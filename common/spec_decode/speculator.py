"""Which sequences speculate and how far, the proposer that drafts for them, and the counters.

Policy (pure Python): a running sequence drafts when it is about to decode (one known token
short of computed), its request did not opt out (SamplingParams.speculative), and it uses no
repetition/frequency/presence penalty and asks for no logprobs. Those two are left out on purpose:
penalties change p at every accepted token, and logprobs would need the raw distribution of each
emitted token; both keep plain decoding. A sequence drafts at most
min(k, tokens left under max_tokens - 1, room left under max_model_len - 1): a step emits at most
drafts + 1 tokens, so more drafts could never be used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.config import EngineConfig
from common.engine.core.sequence import Sequence
from common.models.attention import AttentionBackend
from common.models.llama import LlamaModel
from common.spec_decode.draft_model import DraftModelProposer
from common.spec_decode.ngram import NgramProposer
from common.spec_decode.proposer import Proposer


@dataclass(slots=True)
class SpecDecodeCounters:
    """Totals since the engine started (exported as metrics)."""
    num_drafts: int = 0           # verifications: sequence-steps that carried draft tokens
    num_draft_tokens: int = 0     # draft tokens verified
    num_accepted_tokens: int = 0  # of which the target accepted
    # accepted_per_position[j]: how often draft j + 1 was accepted (drafts j + 1 and before).
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int):
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.counters = SpecDecodeCounters(accepted_per_position=[0] * num_speculative_tokens)

    def max_drafts(self, seq: Sequence) -> int:
        p = seq.params
        if (not p.speculative or p.needs_penalties or p.logprobs is not None
                or seq.num_uncomputed_tokens != 1):
            return 0
        return min(self.k, p.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1)

    def propose(self, running: list[Sequence]) -> dict[str, torch.Tensor]:
        """Set spec_token_ids on the running sequences; returns the proposal distributions of
        sampled drafts by request id (see Draft.probs)."""
        seqs: list[Sequence] = []
        limits: list[int] = []
        for seq in running:
            if seq.spec_token_ids:  # left from a step that did not schedule it
                seq.spec_token_ids = []
            limit = self.max_drafts(seq)
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        if not seqs:
            return {}
        probs: dict[str, torch.Tensor] = {}
        for seq, draft in zip(seqs, self.proposer.propose(seqs, limits), strict=True):
            seq.spec_token_ids = draft.token_ids
            if draft.probs is not None:
                probs[seq.request_id] = draft.probs
        return probs

    def record(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        c = self.counters
        for drafted, accepted in zip(num_drafts, num_accepted, strict=True):
            if drafted:
                c.num_drafts += 1
                c.num_draft_tokens += drafted
                c.num_accepted_tokens += accepted
                for j in range(accepted):
                    c.accepted_per_position[j] += 1

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)


def make_speculator(config: EngineConfig, max_model_len: int, *, num_blocks: int,
                    backend: AttentionBackend, draft_model: LlamaModel | None = None,
                    ) -> Speculator | None:
    """The speculator config asks for (None when speculation is off). num_blocks: the target's
    KV pool size, which the draft's pool matches (the runner reserved memory for both)."""
    proposer: Proposer
    if config.speculative.method is None:
        return None
    if config.speculative.method == "ngram":
        proposer = NgramProposer(config.speculative.prompt_lookup_min, config.speculative.prompt_lookup_max)
    else:
        assert draft_model is not None, "load the draft model first (load_draft_model)"
        proposer = DraftModelProposer(draft_model, num_blocks, config.cache.block_size, backend,
                                      config.scheduler.max_num_batched_tokens)
    return Speculator(proposer, config.speculative.num_tokens, max_model_len)
