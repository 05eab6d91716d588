"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
sequence's last n tokens (n from max down to min) in its prompt and output. Pure Python.

Each sequence keeps an index from every n-gram to where its latest occurrence ends; appending
tokens only adds the n-grams that end at the new positions, so a step costs
O(new tokens * (max - min + 1)), not a scan of the whole sequence.
"""

from __future__ import annotations

from common.engine.core.sequence import Sequence
from common.spec_decode.proposer import Draft, Proposer


class NgramIndex:
    """Latest end position (exclusive) of every n-gram of one growing token list, for n in
    [min_n, max_n]. The occurrence that ends at the list's end (the query) is never indexed."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {}
        self.num_indexed = 0  # n-grams ending before this position are in last_end
        self._reset()

    def _reset(self) -> None:
        self.last_end = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self.num_indexed = 0

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix of tokens (tokens only ever grow between calls)."""
        length = len(tokens)
        if length < self.num_indexed:  # not the list this index was built on: start over
            self._reset()
        for end in range(max(self.num_indexed, self.min_n), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.last_end[n][tuple(tokens[end - n:end])] = end
        self.num_indexed = length
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.last_end[n].get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, max_tokens, strict=True):
            index = self.indexes.get(seq.request_id)
            if index is None:
                index = self.indexes[seq.request_id] = NgramIndex(self.min_n, self.max_n)
            drafts.append(Draft(index.lookup(seq.token_ids, k)))
        return drafts

    def forget(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)
