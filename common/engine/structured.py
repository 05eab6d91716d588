"""Structured outputs: grammars compiled once by content, one matcher per request, the token mask.

    SamplingParams.structured (core/sampling_params.py, pure Python)
        |  GrammarCache.get(): a Future of the compiled grammar; xgrammar compiles it on the
        |  cache's one worker thread, never on the engine's; equal specs share one entry (LRU)
        v
    GrammarState (Sequence.grammar)   not `ready` while the future runs: the scheduler skips it
        |  activate(): the matcher, fed every output the request already has (a first token
        |              sampled by a prefill service, a migrated request's delivered tokens)
        |  accept(token): the engine feeds each new output; False when the grammar rejects it
        v
    TokenMasker.apply() in the sampler: every constrained row's allowed tokens filled as a
        bitmask on the host in one xgrammar call, copied to the device through pinned memory
        without a sync, applied to every constrained row of the batch at once

A grammar that allows no next token (a dead end) gets its stop tokens allowed instead: the row
samples one, the matcher rejects it, and the engine finishes the request with reason "grammar"
rather than sampling from an all -inf row. A spec the parser refuses fails its future with an
InvalidRequestError carrying the parser's message (the engine ends the request with it).
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.engine.core.sampling_params import StructuredOutput
from common.errors import InvalidRequestError
from common.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr


def _xgr():
    """xgrammar, imported on first use: at start-up on the compile thread when the engine warms
    the cache (--grammar-warmup, default on), else with the first constrained request (it
    imports transformers: about 1 s and 64 MiB with the compiler, measured on the CPU box)."""
    import xgrammar

    return xgrammar

# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:line: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int,
                   stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: each id's raw token string (ids the tokenizer lacks, up
    to the model's vocab_size, stay empty and are never allowed), its decoding scheme detected from
    tokenizer.json, and the tokens that end a grammar."""
    encoded = [""] * vocab_size
    for token, i in tokenizer.raw_vocab().items():
        if i < vocab_size:
            encoded[i] = token
    meta = _xgr().TokenizerInfo._detect_metadata_from_hf(tokenizer.backend_json())
    return _xgr().TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids),
                             add_prefix_space=meta["add_prefix_space"])


def choice_grammar(choices: tuple[str, ...]) -> str:
    """The EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _parser_message(exc: Exception) -> str:
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)


class GrammarCache:
    """Compiled grammars by content, compiled on one worker thread.

    get() returns the same Future for equal specs while the entry lives (at most `max_entries`,
    least recently used evicted; a refused spec is cached too and fails at once next time). Only
    the engine's thread calls get(); futures complete on the worker."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_entries: int = 256):
        self._make_info = lambda: tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # built on the worker, on first use
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._entries: OrderedDict[StructuredOutput, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._max_entries = max_entries
        self.stop_token_ids = stop_token_ids
        self.vocab_size = vocab_size

    def get(self, spec: StructuredOutput,
            on_done: Callable[[], None] | None = None) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of spec, now or later; on_done runs when it is (on the worker's
        thread, or at once if it already is)."""
        future = self._entries.get(spec)
        if future is None:
            future = self._pool.submit(self._compile, spec)
            self._entries[spec] = future
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(spec)
        if on_done is not None:
            future.add_done_callback(lambda _f: on_done())
        return future

    def warm_up(self) -> Future[xgr.GrammarCompiler]:
        """Import xgrammar and build the compiler on the worker now, before any request needs
        them (EngineConfig's grammar_warmup)."""
        return self._pool.submit(self._compiler_ready)

    def _compiler_ready(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            self._compiler = _xgr().GrammarCompiler(self._make_info(), max_threads=1,
                                                 cache_enabled=False)
        return self._compiler

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        c = self._compiler_ready()
        try:
            if spec.kind == "json":
                return c.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":
                return c.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                return c.compile_grammar(choice_grammar(spec.choices))
            return c.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as e:  # the parsers' errors
            label = {"json": "JSON schema", "regex": "regex", "grammar": "grammar",
                     "choice": "choice"}.get(spec.kind, spec.kind)
            raise InvalidRequestError(f"invalid {label}: {_parser_message(e)}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's place in its grammar. Not `ready` until its grammar is compiled and
    activate() has run; until then accept() takes any token (activate feeds them all)."""

    def __init__(self, future: Future[xgr.CompiledGrammar], stop_token_ids: tuple[int, ...]):
        self.future = future
        self.stop_token_ids = stop_token_ids
        self.matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""
        return self.matcher is not None and self.matcher.is_terminated()

    def activate(self, outputs: list[int]) -> bool:
        """Make the matcher (the future must be done: raises its InvalidRequestError if the spec
        was refused) and feed it `outputs`; False if it rejects one of them."""
        self.matcher = _xgr().GrammarMatcher(self.future.result())
        return all(self.accept(t) for t in outputs)

    def accept(self, token_id: int) -> bool:
        """Advance by one output token; False if the grammar does not allow it here."""
        if self.matcher is None:
            return True
        return not self.matcher.is_terminated() and self.matcher.accept_token(token_id)


class TokenMasker:
    """Applies the constrained rows' grammars to a batch's logits (the sampler owns one).

    Per call: one xgrammar call fills every constrained row's bitmask on the host (a C++ loop,
    threaded for large batches: fill_threads), one vectorised check finds dead ends, and one
    apply masks the rows: on the CPU by bitwise torch ops (apply_bitmask_cpu); on CUDA by one
    launch of xgrammar's Triton kernel after one non_blocking copy of one pinned buffer that
    holds the bitmask and the constrained rows' indices. The sampler runs after the step's
    forward is launched, so on CUDA the host fills while the device runs the forward. Two pinned
    buffers take turns: each is reused only after the copy that read it two calls ago has
    finished (its event; by then that step's tokens have been read, so the wait costs nothing),
    so the copy runs without a host sync."""

    def __init__(self) -> None:
        self._batch: dict[int, xgr.BatchGrammarMatcher] = {}  # by thread count, made on use
        # Flat int32 staging: [n * words] the bitmask, row r for logits row r, then (CUDA) the
        # constrained rows' indices.
        self._host: list[torch.Tensor | None] = [None, None]
        self._device: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._scratch: torch.Tensor | None = None  # apply_bitmask_cpu's, kept across calls

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """In place: logits [n, vocab] float32; rows[j] is constrained by states[j]."""
        n, vocab = logits.shape
        words = (vocab + 31) // 32
        if logits.device.type != "cuda":
            mask = self._staging(0, n * words, pinned=False)[:n * words].view(n, words)
            self.fill(mask, rows, states)
            if len(rows) == n:
                self._scratch = apply_bitmask_cpu(logits, mask, self._scratch)
            else:
                index = torch.tensor(rows, dtype=torch.long)
                sub = logits.index_select(0, index)
                self._scratch = apply_bitmask_cpu(sub, mask.index_select(0, index),
                                                  self._scratch)
                logits.index_copy_(0, index, sub)
            return
        turn, self._turn = self._turn, self._turn ^ 1
        size = n * words + len(rows)
        host = self._staging(turn, size, pinned=True)
        self.fill(host[:n * words].view(n, words), rows, states)
        host.numpy()[n * words:size] = rows
        device = self._device[turn]
        if device is None or device.numel() < host.numel():
            device = self._device[turn] = torch.empty_like(host, device=logits.device)
        device[:size].copy_(host[:size], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[turn] = event
        _xgr().apply_token_bitmask_inplace(logits, device[:n * words].view(n, words),
                                           vocab_size=vocab, indices=device[n * words:size],
                                           backend="triton")

    def fill(self, bitmask: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """Write states[j]'s allowed next tokens into bitmask[rows[j]] (int32 [n, ceil(vocab /
        32)] on the host) in one call; a dead end allows the stop tokens instead (see the
        module docstring)."""
        matchers = [state.matcher for state in states]
        assert all(m is not None for m in matchers), "fill() before activate()"
        threads = fill_threads(len(matchers))
        batch = self._batch.get(threads)
        if batch is None:
            batch = self._batch[threads] = _xgr().BatchGrammarMatcher(threads)
        batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        words = bitmask.numpy()
        for j in np.flatnonzero(~words[rows].any(axis=1)):
            row = words[rows[j]].view(np.uint32)
            for t in states[j].stop_token_ids:
                row[t // 32] |= np.uint32(1 << (t % 32))

    def _staging(self, turn: int, size: int, pinned: bool) -> torch.Tensor:
        """Host buffer `turn` (flat int32, at least `size`), once the copy that last read it is
        done."""
        event = self._copied[turn]
        if event is not None:
            event.synchronize()
        host = self._host[turn]
        if host is None or host.numel() < size:
            grown = max(size, 2 * host.numel() if host is not None else 0)
            host = self._host[turn] = torch.empty(grown, dtype=torch.int32, pin_memory=pinned)
        return host


def fill_threads(rows: int) -> int:
    """Threads for one batched fill of `rows` matchers. Each thread costs a fixed ~40 us to start
    and join, so below 64 rows one thread is fastest (H200 host, 16 cores, JSON-schema rows:
    32 rows 129 us on 1 thread, 164 on 2, 332 on 8); from 64 rows a thread per 16 rows, up to
    half the cores (64 rows: 552 us on 1, 258 on 4; 256 rows: 1368 on 1, 817 on 8)."""
    if rows < 64:
        return 1
    return max(1, min((os.cpu_count() or 2) // 2, rows // 16))


_NEG_INF_BITS = -8388608  # float32 -inf (0xff800000) as an int32
_BIT_SHIFTS = torch.arange(31, -1, -1, dtype=torch.int32)  # moves bit j to the sign bit


def apply_bitmask_cpu(logits: torch.Tensor,  # [k, vocab] float32, contiguous
                      bitmask: torch.Tensor,  # [k, ceil(vocab / 32)] int32: bit t % 32 of
                      #                         word t // 32 set where token t is allowed
                      scratch: torch.Tensor | None = None) -> torch.Tensor:
    """In place: logits[i, t] = -inf where bitmask[i] forbids t; returns the int32 scratch it
    used (pass it back next time: a fresh one page-faults 4 bytes per logit in).

    Bitwise ops on the floats' bits, each a vectorised pass: m = (word << (31 - bit)) >> 31 is
    -1 where allowed and 0 where not, and x = NEG ^ ((x ^ NEG) & m) keeps x or makes it -inf.
    xgrammar's CPU kernel tests element by element: 4.8 ms for 32 JSON-schema rows of SmolLM2's
    49,152 tokens on the 2-core box (one thread), this ~1 ms."""
    k, vocab = logits.shape
    words = bitmask.shape[1]
    if logits.dtype != torch.float32 or not logits.is_contiguous() or words * 32 < vocab or (
            bitmask.dtype != torch.int32 or bitmask.shape[0] != k):
        raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype} (contiguous float32) and "
                         f"bitmask {tuple(bitmask.shape)} {bitmask.dtype} do not match")
    if scratch is None or scratch.numel() < k * words * 32:
        scratch = torch.empty(k * words * 32, dtype=torch.int32)
    allowed = scratch[:k * words * 32].view(k, words, 32)
    torch.bitwise_left_shift(bitmask.unsqueeze(-1), _BIT_SHIFTS, out=allowed)
    allowed.bitwise_right_shift_(31)
    bits = logits.view(torch.int32)
    bits.bitwise_xor_(_NEG_INF_BITS).bitwise_and_(allowed.view(k, words * 32)[:, :vocab])
    bits.bitwise_xor_(_NEG_INF_BITS)
    return scratch
