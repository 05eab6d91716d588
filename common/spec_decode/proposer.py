"""Draft-token proposers: the cheap guess of what follows a sequence's known tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.engine.core.sequence import Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Draft:
    token_ids: list[int]
    # [len(token_ids), vocab]: the distribution q each draft token was sampled from. None when
    # the proposer chose deterministically (q is one-hot on its token): n-gram lookup, greedy drafts.
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Implementations: NgramProposer (prompt lookup) and DraftModelProposer (a smaller model).

    propose() is called once per step, before scheduling, with the running sequences that are
    one token short of their known tokens (about to decode). A proposer may keep per-request
    state (an index, draft KV blocks) between calls; it must then key that state by request id
    and expect any of the sequence's tokens after its computed ones to differ from last time
    (drafts it proposed that were rejected).
    """

    @abstractmethod
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        """For each seqs[i], at most max_tokens[i] (>= 1) tokens to follow seqs[i].token_ids;
        fewer, or none, are fine."""

    def forget(self, request_id: str) -> None:  # noqa: B027 (stateless proposers need nothing)
        """Drop a request's state (finished, aborted or preempted); unknown ids are ignored."""
