"""Per-request sampling settings, validated at construction (pure Python, no torch)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from common.errors import InvalidRequestError

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output text, compiled by common/engine/structured.py (xgrammar).

        json         value: a JSON Schema (JSON text); the output is one JSON value it accepts
        json_object  any JSON object (value and choices empty)
        regex        value: a regular expression the whole output matches
        choice       choices: the output is exactly one of these strings
        grammar      value: an EBNF grammar (GBNF style, start rule `root`)

    Checked here only as far as pure Python can (a schema must be a JSON object, a choice
    non-empty); the engine compiles it and refuses what its parsers refuse."""
    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"structured output kind must be one of "
                                      f"{', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            if not self.choices:
                raise InvalidRequestError("structured output choice needs at least one string")
        elif self.choices:
            raise InvalidRequestError(f"choices are only for kind choice, not {self.kind}")
        if self.kind in ("json", "regex", "grammar") and not self.value:
            raise InvalidRequestError(f"structured output {self.kind} is empty")
        if self.kind == "json":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from e
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError("a JSON schema must be an object (or true/false)")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to return with each token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Opt out of speculative decoding (when the engine has it on). Requests with penalties or
    # logprobs never speculate: see common/spec_decode/speculator.py.
    speculative: bool = True
    # Constrain the output to a schema, regex, choice or grammar; a constrained request never
    # speculates (its drafts would need the grammar's mask and rollback), so this sets
    # `speculative` to False.
    structured: StructuredOutput | None = None
    # Choices to generate from the one prompt (OpenAI's n): the engine computes the prompt once
    # and forks the sequence when its first token is out; choice i samples with seed + i.
    n: int = 1
    # Return each prompt position's log-probability and this many most likely alternatives
    # (vLLM's prompt_logprobs); None: none.
    prompt_logprobs: int | None = None

    MAX_LOGPROBS = 20
    MAX_STOP_STRINGS = 64

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.structured is not None:
            self.speculative = False
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1 (off) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
             f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}"),
            (len(self.stop) <= self.MAX_STOP_STRINGS,
             f"at most {self.MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (self.seed is None or 0 <= self.seed < 2**63, f"seed out of range: {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    def choice(self, index: int) -> SamplingParams:
        """The settings of choice `index` of an n > 1 request: one choice, seed + index (the
        prompt's logprobs, computed once, go with choice 0)."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return dataclasses.replace(self, n=1, seed=seed,
                                   prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
