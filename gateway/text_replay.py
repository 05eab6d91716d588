"""The text of a request's output, computed in the gateway exactly as a decode engine computes it.

A migrated request continues on another decode service with the tokens generated so far appended
to its prompt. That engine's detokenizer and stop-string matcher would start from scratch: a stop
string straddling the migration point would be missed, and text held back as a possible stop
prefix would be lost. So after a migration the gateway writes the text itself: TextReplay runs
the tokens the client already has through the same IncrementalDetokenizer and StopChecker the
engine uses (common/text/detokenizer.py), then each new token, with the engine's rules
(LLMEngine._append): a stop string ends the request once min_tokens are out; any other finish
releases the held-back tail.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.engine.core.sampling_params import SamplingParams
from common.text.detokenizer import Decoder, IncrementalDetokenizer, StopChecker


class TextReplay:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int],
                 params: SamplingParams):
        self._detok = IncrementalDetokenizer(tokenizer, list(prompt_token_ids),
                                             params.skip_special_tokens)
        self._stops = StopChecker(params.stop, params.include_stop_str_in_output)
        self._min_tokens = params.min_tokens
        self.num_tokens = 0
        self.raw = ""    # everything detokenized
        self.text = ""   # what the engine would have emitted so far

    def add(self, token_id: int, finishing: bool = False) -> tuple[str, bool]:
        """One output token: (text to emit, stopped by a stop string). finishing: the engine
        ended the request with this token for another reason (EOS, stop id, length)."""
        self.num_tokens += 1
        delta = self._detok.add([token_id])
        self.raw += delta
        emit, stopped = self._stops.check(self.raw, delta)
        if stopped and self.num_tokens >= self._min_tokens:
            self.text += emit
            return emit, True
        if finishing:
            emit += self._stops.flush()
        self.text += emit
        return emit, False
