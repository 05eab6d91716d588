"""Streaming text for a request: token ids -> text deltas, and stop strings (no torch).

IncrementalDetokenizer decodes a short window of recent tokens each step instead of the whole
output, and never emits a U+FFFD that only stands for a UTF-8 character still incomplete:

    tokens:          [ prompt tail | out0 out1 ... outN ]     window = tokens[start:]
    decode(window):  "context+already emitted" "new"  "\ufffd"   <- held until complete
                                               ^ the delta returned

Decoding from a token before the new ones keeps word-initial spaces that some decoders strip at the
start of a sequence (SentencePiece "▁Paris" decodes alone as "Paris", after context as " Paris").

StopChecker cuts the text at the first stop string and holds back a tail that might still become
one, so a client never sees text that is later taken back. Use per step:

    delta = detok.add(new_ids); full += delta
    emit, stopped = stops.check(full, delta, can_stop=num_outputs >= min_tokens)
    on a finish for another reason (EOS, length): run detok.flush() through check, then
    emit stops.flush()
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"
# Tokens of context kept before the newest tokens, and the window length that triggers a slide.
_CONTEXT_TOKENS = 4
_MAX_WINDOW_TOKENS = 16


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """add() returns the text each batch of new tokens adds. The deltas, followed by flush() when
    the request ends, concatenate to the text the outputs add after the prompt; for byte-level
    BPE (SmolLM2, GPT-2, Llama 3) that is exactly tokenizer.decode(output_ids)."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._start = 0
        context = self._decode_window()
        if context.endswith(_REPLACEMENT):  # the prompt ends inside a character: no context
            self._tokens = []
            context = ""
        self._emitted = len(context)  # chars of decode(window) already accounted for
        self._last_text = context

    def add(self, token_ids: list[int]) -> str:
        pieces = []
        for token_id in token_ids:  # one at a time: a batch gives what single tokens would
            self._tokens.append(token_id)
            pieces.append(self._step())
        return "".join(pieces)

    def flush(self) -> str:
        """The text still held at the end: a trailing character that never completed (U+FFFD)."""
        rest = self._last_text[self._emitted:]
        self._emitted = len(self._last_text)
        return rest

    def _decode_window(self) -> str:
        return self._tokenizer.decode(self._tokens[self._start:], skip_special_tokens=self._skip)

    def _step(self) -> str:
        text = self._decode_window()
        self._last_text = text
        stable = len(text.rstrip(_REPLACEMENT))  # a trailing U+FFFD may be a partial character
        delta = text[self._emitted:stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if stable == len(text) and len(self._tokens) - self._start > _MAX_WINDOW_TOKENS:
            # Everything is out: restart the window a few tokens back (those tokens are context).
            self._start = len(self._tokens) - _CONTEXT_TOKENS
            self._last_text = self._decode_window()
            self._emitted = len(self._last_text)
        return delta


class StopChecker:
    """check(full_text, new_delta): full_text is the whole output text so far, ending with
    new_delta. Returns (text to send now, stopped). Only a stop string that completes inside
    new_delta counts; the one that completes first wins (the longest where several complete at
    the same character), so the result does not depend on how the text was split into deltas.
    can_stop=False (min_tokens not reached yet) ignores completed stop strings but still holds
    back a possible beginning of one. Once stopped, the checker must not be called again."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = sorted(set(stop), key=len, reverse=True)
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stop), default=0)
        # Every proper prefix of a stop string: a text tail equal to one of them is held back.
        self._prefixes = {s[:i] for s in self._stop for i in range(1, len(s))}
        self._first_chars = {s[0] for s in self._stop}
        self._emitted = 0  # chars of full_text sent (or, after a stop, the final length)
        self._held = ""

    def check(self, full_text: str, new_delta: str, can_stop: bool = True) -> tuple[str, bool]:
        if not self._stop:
            self._emitted = len(full_text)
            return new_delta, False
        match = self._first_match(full_text, len(full_text) - len(new_delta)) if can_stop else None
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._include else start
            emit = full_text[self._emitted:end]
            self._emitted, self._held = end, ""
            return emit, True
        hold_from = self._hold_from(full_text)
        emit = full_text[self._emitted:hold_from]
        self._emitted, self._held = hold_from, full_text[hold_from:]
        return emit, False

    def flush(self) -> str:
        """At the end of generation for another reason: release the held tail."""
        held, self._held = self._held, ""
        self._emitted += len(held)
        return held

    @property
    def num_emitted_chars(self) -> int:
        """Length of the output text sent so far; after a stop, the truncated text's length."""
        return self._emitted

    def _first_match(self, text: str, new_from: int) -> tuple[int, str] | None:
        # A match ending past new_from starts in the held tail or the new text: an earlier start
        # would have made its beginning a held prefix. Nothing before _emitted is searched.
        best: tuple[int, str] | None = None
        best_end = len(text) + 1
        for stop in self._stop:  # longest first, so a tie on the end keeps the longest
            start = text.find(stop, max(self._emitted, new_from - len(stop) + 1))
            if start >= 0 and start + len(stop) < best_end:
                best, best_end = (start, stop), start + len(stop)
        return best

    def _hold_from(self, text: str) -> int:
        """Where the longest tail of text that begins a stop string starts (len(text) if none)."""
        for i in range(max(self._emitted, len(text) - self._max_len + 1), len(text)):
            if text[i] in self._first_chars and text[i:] in self._prefixes:
                return i
        return len(text)
